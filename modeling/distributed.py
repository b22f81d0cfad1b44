"""Data parallelism across the processes ``torchrun`` starts: one batch, split by tokens.

    torchrun --no-python --nproc-per-node 4 matformer-train ...  # or -m matformer.client.standalone

Each process (rank) trains its share of every batch and the gradients are summed across
ranks before anyone uses them, so every rank holds the same gradient, takes the same step
and keeps the same weights: the gradient of the whole batch, as one process would compute
it. NCCL carries the tensors between GPUs, Gloo between CPU processes.

Why the gradient is summed after the batch rather than by DDP's hooks during backward:
a rank's microbatches adapt to its own out-of-memory errors (modeling/batching/runner.py)
and one step may backpropagate several tiers, so ranks run different numbers of backward
passes; a collective inside one of them would hang the others. One sum per step, after
the rank's passes, is the same arithmetic DDP does (a bucketed all-reduce) with none of
that coupling. The same sum serves a federated client's pseudo-gradients.

``sharded`` (``--fsdp``) is for a model that does not fit one device: PyTorch's FSDP2
(``fully_shard``) keeps each rank's shard of every weight, gradient and optimizer state and
gathers a layer's weights only while it runs. Each forward pass then gathers and each
backward pass reduces, so the ranks must run their passes in lockstep: every rank runs as
many microbatches as the busiest one (the others add passes that contribute zero), and
microbatches do not adapt to out-of-memory errors (``modeling/training.py``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from matformer.modeling.errors import ConfigError

BUCKET_VALUES = 1 << 24  # values per all-reduce call (64 MiB of float32), as DDP buckets
PULSES_PER_TIMEOUT = 5  # a watched rank shows it lives this many times per timeout
FOREVER = timedelta(days=365)  # a follower's wait for rank 0's next message


@dataclass(frozen=True, slots=True)
class DataParallel:
    """This process's place in a data-parallel group that ``torch.distributed`` runs."""

    rank: int
    world_size: int
    device: torch.device
    sharded: bool = False  # FSDP2: weights, gradients and optimizer state in shards
    watch: Liveness | None = None  # the ranks watch each other (``watched``)

    @classmethod
    def from_environment(cls, device: torch.device, sharded: bool = False
                         ) -> DataParallel | None:
        """The group ``torchrun`` described in the environment (WORLD_SIZE > 1), joined, or
        None for a single process. Under CUDA each rank takes ``cuda:LOCAL_RANK``."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            if sharded:
                raise ConfigError("--fsdp shards the model over the ranks torchrun starts; "
                                  "start with torchrun --nproc-per-node N (N >= 2).")
            return None
        rank = int(os.environ["RANK"])
        if device.type == "cuda":
            if device.index not in (None, 0):
                raise ConfigError(
                    f"under torchrun each rank takes the GPU of its local rank; give --device "
                    f"cuda, not {device}.")
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(device)
        elif device.type != "cpu":
            raise ConfigError(f"data parallelism runs on CUDA (NCCL) or CPU (Gloo), not "
                              f"{device.type}.")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return cls(rank=rank, world_size=world, device=device, sharded=sharded)

    def watched(self, timeout_s: float, on_silence: Callable[[int, float], None]
                ) -> DataParallel:
        """This group with its ranks watching each other (``Liveness``): ``on_silence(rank,
        seconds)`` runs when a rank has shown no sign of life for ``timeout_s``."""
        return dataclasses.replace(self, watch=Liveness(self, timeout_s, on_silence))

    @property
    def leader(self) -> bool:
        """Rank 0: the one that logs, evaluates, saves and talks to a coordinator."""
        return self.rank == 0

    def share(self, sizes: Sequence[int]) -> list[int]:
        """Which of the batch's items (rows, of ``sizes`` tokens each) this rank trains.

        Longest first, each to the rank with the fewest tokens so far (ties to the lower
        rank): every rank computes the same split, and the ranks' token counts differ by
        at most one item."""
        load = [0] * self.world_size
        mine = []
        for index in sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True):
            rank = min(range(self.world_size), key=load.__getitem__)
            load[rank] += sizes[index]
            if rank == self.rank:
                mine.append(index)
        return sorted(mine)

    def sum_(self, values: Tensor) -> Tensor:
        """``values`` summed over the ranks, in place."""
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
        return values

    def sum_gradients(self, model: nn.Module) -> None:
        """Every parameter's gradient summed over the ranks, in buckets of one flat tensor
        each; a rank that had nothing to train contributes zeros."""
        parameters = [p for p in model.parameters() if p.requires_grad]
        for p in parameters:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: list[Tensor] = []
        for p in parameters:
            bucket.append(p.grad)
            if sum(g.numel() for g in bucket) >= BUCKET_VALUES:
                self._sum_bucket(bucket)
                bucket = []
        if bucket:
            self._sum_bucket(bucket)

    def _sum_bucket(self, grads: list[Tensor]) -> None:
        flat = self.sum_(torch.cat([g.reshape(-1) for g in grads]))
        for grad, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
            grad.copy_(part.view_as(grad))

    def broadcast_parameters(self, model: nn.Module) -> None:
        """Rank 0's weights (and buffers) on every rank, as DDP does when it wraps a model."""
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, src=0)

    def most(self, count: int) -> int:
        """The largest of the ranks' ``count``."""
        value = torch.tensor([count], dtype=torch.int64, device=self.device)
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return int(value.item())

    def shard(self, model: nn.Module) -> None:
        """FSDP2 over the ranks: each block its own unit, the rest (embeddings, final norm,
        output head) the root's. Gradients are summed, not averaged, over the ranks: every
        rank already divides its loss by the whole batch's target count."""
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        for module in model.modules():
            if hasattr(module, "set_gradient_divide_factor"):
                # plain sums: Gloo has no pre-multiplied sum for a factor to ride on
                module.set_force_sum_reduction_for_comms(True)
                module.set_gradient_divide_factor(1.0)

    def full_state(self, model: nn.Module) -> dict[str, Tensor]:
        """The whole of every weight (a collective: every rank calls it), on the CPU."""
        return self.gather_tensors(model.state_dict())

    def gather_tensors(self, tree: Any) -> Any:
        """``tree`` (an optimizer's ``state_dict``, say) with each sharded tensor replaced by
        the whole of it on the CPU; a collective, every rank calling it on the same tree."""
        if hasattr(tree, "full_tensor"):
            return tree.full_tensor().cpu()
        if isinstance(tree, Tensor):
            return tree.cpu()
        if isinstance(tree, dict):
            return {key: self.gather_tensors(value) for key, value in tree.items()}
        if isinstance(tree, list | tuple):
            return type(tree)(self.gather_tensors(value) for value in tree)
        return tree

    def broadcast_object(self, value: Any = None) -> Any:
        """Rank 0's ``value`` on every rank (pickled; for small control messages). Watched,
        the followers wait for it in the store rather than inside the collective, which would
        give up after the process group's timeout: rank 0 may take a whole round to send it."""
        if self.watch is not None and self.leader:
            self.watch.announce()
        elif self.watch is not None:
            self.watch.await_announcement()
        box = [value]
        dist.broadcast_object_list(box, src=0, device=self.device)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        """Leave the group. Every rank waits for the others first: a rank that tears its
        connections down while a peer still uses them makes Gloo abort that peer."""
        if dist.is_initialized():
            dist.barrier()
            if self.watch is not None:
                self.watch.stop()  # after the barrier: every rank is leaving, none is hung
            dist.destroy_process_group()


class Liveness:
    """The ranks of a group watching each other through torchrun's TCP store.

    A rank whose peer is stopped or hung waits inside a collective until the process group's
    timeout (30 minutes under Gloo), and a follower cannot simply time out its wait for rank
    0's next message: rank 0 may spend a whole round with a coordinator. So each rank bumps a
    counter of its own from a thread (a stopped process's threads stop with it) and reads the
    others'; a peer whose counter stays still for ``timeout_s`` of this rank's own time is
    reported once to ``on_silence(rank, timeout_s)``, from a thread: the main thread may be
    blocked for good. A separate thread judges, so a store that stops answering (hosted by
    the stopped rank itself) is noticed too."""

    def __init__(self, parallel: DataParallel, timeout_s: float,
                 on_silence: Callable[[int, float], None]) -> None:
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise ConfigError(f"the ranks' timeout is a positive number of seconds, not "
                              f"{timeout_s}.")
        self.rank = parallel.rank
        self.peers = [r for r in range(parallel.world_size) if r != parallel.rank]
        self.timeout_s = timeout_s
        self.period_s = timeout_s / PULSES_PER_TIMEOUT
        self.on_silence = on_silence
        # one connection for the messages, one for the pulses: a client does one call at a
        # time, and a follower's wait for a message may last a whole round
        self.store, self.pulse_store = self._connect(), self._connect()
        self.told = 0  # messages rank 0 has announced, or this follower has awaited
        self.ticks = 0  # the judge's ticks so far
        self.moved = dict.fromkeys(self.peers, 0)  # tick at which each peer last moved
        self.stopped = threading.Event()
        for target in (self._pulse, self._judge):
            threading.Thread(target=target, name=f"liveness-{target.__name__}",
                             daemon=True).start()

    def announce(self) -> None:
        """Rank 0: a message follows, for every follower."""
        self.told += 1
        for rank in self.peers:
            self.store.set(f"told/{rank}/{self.told}", "")

    def await_announcement(self) -> None:
        """A follower: wait, however long, until rank 0 announces its next message."""
        self.told += 1
        key = f"told/{self.rank}/{self.told}"
        self.store.wait([key], FOREVER)
        self.store.delete_key(key)

    def stop(self) -> None:
        self.stopped.set()

    def _connect(self) -> dist.Store:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=timedelta(seconds=self.timeout_s))
        # torchrun keeps its store across restarts of the ranks: keys of one attempt each
        return dist.PrefixStore(f"matformer/{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}",
                                store)

    def _pulse(self) -> None:
        counts: dict[int, int] = {}
        while not self.stopped.is_set():
            try:
                self.pulse_store.add(f"pulse/{self.rank}", 1)
                for rank in self.peers:
                    count = self.pulse_store.add(f"pulse/{rank}", 0)
                    if counts.get(rank) != count:
                        counts[rank] = count
                        self.moved[rank] = self.ticks
            except dist.DistError:
                pass  # a store that does not answer shows no peer moving: the judge decides
            self.stopped.wait(self.period_s)

    def _judge(self) -> None:
        # counted in ticks, not wall time: while this process was paused nobody was judged
        while not self.stopped.wait(self.period_s):
            self.ticks += 1
            for rank, moved in self.moved.items():
                if self.ticks - moved > PULSES_PER_TIMEOUT:
                    self.on_silence(rank, self.timeout_s)
                    return


def shard_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]
                          ) -> dict[str, Any]:
    """A whole optimizer ``state_dict`` (``gather_tensors``'s) with each parameter's state
    cut to this rank's shard of that parameter, ready for ``optimizer.load_state_dict``.
    Every rank holds the whole state already, so each takes its own part: no messages."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for group in optimizer.param_groups for p in group["params"]]
    sharded = {}
    for index, values in state["state"].items():
        param = params[int(index)]
        sharded[index] = {
            name: distribute_tensor(value.to(param.device), param.device_mesh, param.placements,
                                    src_data_rank=None)
            if isinstance(param, DTensor) and isinstance(value, Tensor)
            and value.shape == param.shape else value
            for name, value in values.items()}
    return {**state, "state": sharded}
