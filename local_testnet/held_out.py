"""Held-out loss of a run's checkpoints, per tier, computed in the testnet's own process.

The held-out sequences are the run's order's held-out tail (``modeling.run_order``, as the
coordinator takes it through ``server.work.work_order``): no round trains them, however many
epochs the run goes through, so the loss is always on unseen sequences.

    held = HeldOut.of(config)                    # config: the run's server.config.RunConfig
    held.loss(checkpoint_dir, tiers=[0, 1, 2])   # {tier: mean loss per target token}
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from matformer.modeling.checkpoint import load_pretrained
from matformer.modeling.matformer import NO_MIXES, TierIds
from matformer.modeling.mdat import Mdat
from matformer.modeling.training import held_out_loss
from matformer.server.config import RunConfig
from matformer.server.work import work_order

MAX_SEQUENCES = 128  # of the tail, so that evaluating stays a few seconds on a CPU
BATCH_TOKENS = 2048


@dataclass(kw_only=True)
class HeldOut:
    examples: list[torch.Tensor]

    @classmethod
    def of(cls, config: RunConfig, sequences: int = MAX_SEQUENCES) -> HeldOut:
        """At most ``sequences`` of the held-out tail, and no more tokens than the run's
        planned rounds train."""
        with Mdat.open(config.data.path) as mdat:
            reader, order = work_order(mdat, config)
            ids = order.evaluated(reader.lengths(), sequences=sequences,
                                  tokens=config.round.planned_rounds
                                  * config.round.tokens_per_round)
            return cls(examples=[torch.from_numpy(reader[int(i)].astype(np.int64)) for i in ids])

    def loss(self, checkpoint: Path, tiers: list[int], tier_ids: TierIds = NO_MIXES
             ) -> dict[int, float]:
        """Mean loss per target token of the universal checkpoint at each tier (an id of
        ``tier_ids``: a Mix'n'Match slice of the run is evaluated layer by layer)."""
        losses = held_out_loss(load_pretrained(checkpoint), self.examples,
                               [tier_ids.resolve(t) for t in tiers], batch_tokens=BATCH_TOKENS)
        return dict(zip(tiers, losses.values(), strict=True))
