"""Held-out loss of a run's checkpoints, per tier, computed in the testnet's own process.

The held-out sequences are the last 5% of the order the run's work queue hands out (the
shuffle's sequences that carry a target, ``server.work.work_order``; as in
client/standalone.py): the coordinator hands it out from its start, so a run that stays
short of that tail never trains on them.

    held = HeldOut.of(config)                    # config: the run's server.config.RunConfig
    held.reached_by(RunState.load(run_dir))      # True: the run trained into the tail
    held.loss(checkpoint_dir, tiers=[0, 1, 2])   # {tier: mean loss per target token}
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from modeling.checkpoint import load_pretrained
from modeling.mdat import Mdat
from modeling.training import held_out_loss
from server.config import RunConfig
from server.state import RunState
from server.work import work_order

HELD_OUT_FRACTION = 0.05
MAX_SEQUENCES = 128  # of the tail, so that evaluating stays a few seconds on a CPU
BATCH_TOKENS = 2048


@dataclass(kw_only=True)
class HeldOut:
    examples: list[torch.Tensor]
    tail_start: int  # position in the order where the held-out tail begins
    size: int  # sequences in the order (one epoch)

    @classmethod
    def of(cls, config: RunConfig) -> HeldOut:
        with Mdat.open(config.data.path) as mdat:
            reader, order = work_order(mdat, config)
            tail = order[len(order) - max(1, int(len(order) * HELD_OUT_FRACTION)):]
            ids = tail[-MAX_SEQUENCES:]
            examples = [torch.from_numpy(reader[int(i)].astype(np.int64)) for i in ids]
        return cls(examples=examples, tail_start=len(order) - len(tail), size=len(order))

    def reached_by(self, state: RunState | None) -> bool:
        """Whether the run handed out sequences from the held-out tail."""
        return state is not None and state.queue.get("position", 0) > self.tail_start

    def loss(self, checkpoint: Path, tiers: list[int]) -> dict[int, float]:
        """Mean loss per target token of the universal checkpoint at each tier."""
        losses = held_out_loss(load_pretrained(checkpoint), self.examples, tiers,
                               batch_tokens=BATCH_TOKENS)
        return dict(zip(tiers, losses.values(), strict=True))
