"""A participant with several devices, started by torchrun as one client:

    torchrun --no-python --nproc-per-node N matformer-client train --server HOST:PORT ...

Rank 0 is the client the coordinator knows: it alone joins, downloads, submits and checks
hashes. The other ranks (followers) hold the same replica and train their share of each
round's sequences (modeling/distributed.py); the gradients, or under local steps each inner
step's gradients, are summed over the ranks before rank 0 compresses the result, so the
node submits what one device with all their memory would. Rank 0 tells the followers what
to do next as small messages (``Node``); weights travel between ranks only when rank 0
loads a checkpoint, and every rank applies each broadcast update itself, as any client does.

The node joins with the memory of all its devices (GPUs add up; CPU ranks share one host's
memory) and the tokens/s its ranks measure together, so the coordinator assigns the tier
and the share of work the whole node can carry.

The ranks watch each other (``Liveness`` in modeling/distributed.py): when one is stopped or
hung for ``--rank-timeout-s``, the others leave with a one-line reason rather than wait in
a collective for good. A follower waits for rank 0's next message however long rank 0
spends with the coordinator, as long as rank 0 shows signs of life.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from matformer.client.local_round import LocalRound, RoundSetup
from matformer.client.probe import measure_tokens_per_second, memory_bytes
from matformer.client.replica import Replica
from matformer.modeling import build_model
from matformer.modeling.compression import RoundUpdate
from matformer.modeling.devices import compile_model
from matformer.modeling.distributed import DataParallel


class Node:
    """Rank 0's side: each method tells the followers to do the same as rank 0 does now.
    Without data parallelism (``parallel`` None) every method does only rank 0's part."""

    def __init__(self, parallel: DataParallel | None) -> None:
        self.parallel = parallel

    @property
    def world_size(self) -> int:
        return 1 if self.parallel is None else self.parallel.world_size

    def _tell(self, command: str, payload: Any = None) -> None:
        if self.parallel is not None:
            self.parallel.broadcast_object((command, payload))

    def memory(self, own: int, device: torch.device) -> int:
        """The node's memory: its GPUs' summed; CPU ranks share one host's."""
        self._tell("memory")
        return _memory(self.parallel, own, device)

    def load(self, replica: Replica, compile_: bool) -> None:
        """Followers take rank 0's freshly loaded weights."""
        self._tell("load", (replica.model.config, compile_))
        if self.parallel is not None:
            self.parallel.broadcast_parameters(replica.model)

    def speed(self, measure: Callable[[], float], probe: dict[str, Any]) -> float:
        """Tokens/s of all ranks measuring at once (``probe``: the measurement's arguments)."""
        self._tell("speed", probe)
        return _speed(self.parallel, measure())

    def apply(self, updates: list[RoundUpdate]) -> None:
        if updates:
            self._tell("apply", updates)

    def setup(self, setup: RoundSetup) -> None:
        self._tell("setup", setup)

    def train(self, sequences: list[torch.Tensor], round_index: int) -> None:
        self._tell("train", ([s.cpu() for s in sequences], round_index))

    def restore(self, local_round: LocalRound) -> None:
        """Followers take rank 0's inner optimizer state (restored or fresh)."""
        optimizer = local_round.optimizer
        self._tell("optimizer", None if optimizer is None else optimizer.state_dict())

    def stop(self, replica_hash: str) -> list[str]:
        """Every rank's replica hash, rank 0's first; the followers leave their loop."""
        self._tell("stop")
        return _hashes(self.parallel, replica_hash)


def follow(parallel: DataParallel) -> None:
    """A follower's loop: do what rank 0 says until it says stop."""
    device = parallel.device
    replica: Replica | None = None
    local_round: LocalRound | None = None
    while True:
        command, payload = parallel.broadcast_object()
        if command == "memory":
            _memory(parallel, memory_bytes(device), device)
        elif command == "load":
            config, compile_ = payload
            replica = Replica(build_model(config).to(device))
            parallel.broadcast_parameters(replica.model)
            if compile_:
                compile_model(replica.model)
            local_round = None
        elif command == "speed":
            _speed(parallel, measure_tokens_per_second(replica.model, **payload))
        elif command == "apply":
            for update in payload:
                replica.apply(update)
        elif command == "setup":
            local_round = payload.build(replica, None, parallel)
        elif command == "train":
            sequences, round_index = payload
            local_round.run([s.to(device) for s in sequences], step=round_index)
        elif command == "optimizer":
            local_round.reset()
            if payload is not None:
                local_round.optimizer.load_state_dict(payload)
        elif command == "stop":
            _hashes(parallel, replica.hash() if replica is not None else "")
            return


def _memory(parallel: DataParallel | None, own: int, device: torch.device) -> int:
    if parallel is None or device.type != "cuda":
        return own
    return int(parallel.sum_(torch.tensor([own], dtype=torch.int64, device=device)).item())


def _speed(parallel: DataParallel | None, own: float) -> float:
    if parallel is None:
        return own
    return float(parallel.sum_(torch.tensor([own], dtype=torch.float64,
                                            device=parallel.device)).item())


def _hashes(parallel: DataParallel | None, own: str) -> list[str]:
    if parallel is None:
        return [own]
    gathered: list[str] = [""] * parallel.world_size
    torch.distributed.all_gather_object(gathered, own)
    return gathered
