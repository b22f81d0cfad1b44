"""One round of a client's local work: gradients, then compression.

The client accumulates the gradient of its assigned sequences at its tier(s) in token-budget
microbatches (``tier_gradients``, as standalone training does before its optimizer step);
the gradient is the result, the step is the coordinator's (docs/architecture.md, "One
round"). Each parameter's gradient, cut to the region the
client trains, goes through that parameter's error feedback and becomes one named
``SparseResult``; the coordinator aggregates them and broadcasts the update, which the
client applies to its ``Replica`` like everyone else.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from client.feedback_state import FeedbackState
from client.replica import Replica
from modeling.batching import AdaptiveLimits, AdaptiveLimitsConfig, MicrobatchRunner
from modeling.compression import Compressor, Region, SparseResult, region_slices, tier_regions
from modeling.config import ModelConfig
from modeling.matformer import Tier
from modeling.training import TierSchedule, tier_gradients


@dataclass(kw_only=True, slots=True)
class RoundWork:
    """What one round of local work produced."""

    results: list[SparseResult]  # one per trained parameter, canonical names
    losses: dict[str, float]  # tier label → mean loss per target token
    tokens: int  # real tokens trained on (the aggregation weight of every result)
    seconds: float  # wall time of the forward/backward passes and the compression


def trained_regions(
    shapes: Mapping[str, Sequence[int]], config: ModelConfig, tiers: Sequence[Tier]
) -> dict[str, Region]:
    """The region of each tensor that some of ``tiers`` trains: the widest one's. A client
    claims no wider region, or its zero gradients would dilute the tail's update."""
    each = [tier_regions(shapes, config, tier) for tier in tiers]
    return {
        name: tuple((0, max(regions[name][dim][1] for regions in each))
                    for dim in range(len(shapes[name])))
        for name in shapes
    }


class LocalRound:
    """Runs rounds of local work on a replica; the error feedback persists across rounds.

    With ``TierSchedule(mode="sample")`` the results still claim the region of the
    schedule's widest tier, so prefer ``mode="all"`` (weighted nested tiers) in a federated
    run.
    """

    def __init__(
        self,
        replica: Replica,
        compressor: Compressor,
        schedule: TierSchedule,
        limits: AdaptiveLimits | None = None,
    ) -> None:
        schedule.check(replica.config)  # every tier within the widths the replica holds
        self.replica = replica
        self.schedule = schedule
        self.runner = MicrobatchRunner(replica.model, limits or AdaptiveLimitsConfig().build())
        regions = trained_regions(replica.shapes, replica.config, schedule.tiers)
        self.feedback = FeedbackState(
            compressor, replica.shapes, {name: regions[name] for name in replica.parameters}
        )

    def run(self, sequences: Sequence[Tensor], step: int = 0) -> RoundWork:
        """Gradients of ``sequences`` (1-D token ids) at the schedule's tiers for ``step``
        (the round number), compressed with error feedback into one result per parameter."""
        start = time.perf_counter()
        losses = tier_gradients(self.runner, sequences, self.schedule, step)
        tokens = sum(len(sequence) for sequence in sequences)
        results = []
        for name, parameter in self.replica.parameters.items():
            feedback = self.feedback[name]
            where = region_slices(feedback.region)
            grad = parameter.grad
            grad = torch.zeros_like(parameter[where]) if grad is None else grad[where]
            results.append(feedback.step(grad, tokens))
        self.replica.model.zero_grad(set_to_none=True)
        return RoundWork(
            results=results, losses=losses, tokens=tokens, seconds=time.perf_counter() - start
        )
