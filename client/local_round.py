"""One round of a client's local work: a gradient or a pseudo-gradient, then compression.

Without local steps the client accumulates the gradient of its assigned sequences at its
tier(s) in token-budget microbatches (``tier_gradients``, as standalone training does before
its optimizer step); the gradient is the result, the step is the coordinator's
(docs/architecture.md, "One round"). With local steps (``LocalSteps``) it trains the
sequences as batches, one inner optimizer step each, and the result is how far its weights
moved (docs/architecture.md, "Local steps"). Either way each parameter's result, cut to the
region the client trains, goes through that parameter's error feedback and becomes one named
``SparseResult``; the coordinator aggregates them and broadcasts the update, which the
client applies to its ``Replica`` like everyone else.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from matformer.client.feedback_state import FeedbackState
from matformer.client.replica import Replica
from matformer.modeling.batching import (
    AdaptiveLimits,
    AdaptiveLimitsConfig,
    MicrobatchRunner,
    pack_rows,
    plan_batches,
    plan_packed,
)
from matformer.modeling.compression import (
    Compressor,
    Region,
    SparseResult,
    region_slices,
    tier_regions,
)
from matformer.modeling.config import ModelConfig
from matformer.modeling.devices import Precision
from matformer.modeling.distributed import DataParallel
from matformer.modeling.matformer import Tier
from matformer.modeling.optim import (
    LocalOptimizer,
    OptimizerConfig,
    constant_after_warmup,
    lr_factor,
)
from matformer.modeling.training import (
    StepOptions,
    TierSchedule,
    clip_gradient,
    tier_gradients,
)
from matformer.protocol.settings import InnerSettings


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


@dataclass(frozen=True, slots=True)
class LocalSteps:
    """Local steps: a round's sequences trained as token-budget batches of ``batch_tokens``,
    one step of ``optimizer`` each; the result is the pseudo-gradient.

    The inner lr is ``optimizer``'s (its warmup counted in the client's own steps) times a
    factor of the round: ``schedule`` from 1 at round 0 to ``final_lr / optimizer.lr`` at
    ``planned_rounds``, the run's clock, the same for every client whatever its speed."""

    optimizer: OptimizerConfig
    batch_tokens: int
    schedule: str = "constant"  # cosine | linear | constant, over the run's rounds
    final_lr: float = 0.0  # the inner lr at the last planned round (cosine, linear)
    planned_rounds: int = 1
    grad_clip: float = 0.0  # each step's gradient norm clipped to this; 0: not clipped

    @classmethod
    def of(cls, inner: InnerSettings | None) -> LocalSteps | None:
        """The local steps the run's settings ask for; None: one gradient per round."""
        if inner is None:
            return None
        optimizer = constant_after_warmup(
            inner.name, lr=inner.lr, weight_decay=inner.weight_decay,
            betas=(inner.beta1, inner.beta2), eps=inner.eps, warmup_steps=inner.warmup_steps)
        return cls(optimizer=optimizer, batch_tokens=inner.batch_tokens,
                   schedule=inner.schedule, final_lr=inner.final_lr,
                   planned_rounds=inner.planned_rounds, grad_clip=inner.grad_clip)

    def lr_scale(self, round_index: int) -> float:
        """The factor on the inner lr during round ``round_index`` (0-based)."""
        return lr_factor(round_index, warmup_steps=0, total_steps=self.planned_rounds,
                         schedule=self.schedule, min_ratio=self.final_lr / self.optimizer.lr)


@dataclass(frozen=True, slots=True)
class RoundSetup:
    """How a client's local rounds train, whatever its weights: what rank 0 of a
    data-parallel participant sends its followers so that every rank trains alike."""

    tiers: tuple[Tier, ...]  # the client's tier first, then smaller ones trained alongside
    microbatch_tokens: int
    microbatch_examples: int = 64
    pad_to_multiple_of: int = 1  # each row padded to a multiple of this many tokens
    steps: LocalSteps | None = None
    precision: str = "fp32"
    row_length: int | None = None  # packed rows of this many tokens; None: padded
    seed: int = 0  # of a masked model's draws

    def build(self, replica: Replica, compressor: Compressor | None,
              parallel: DataParallel | None = None) -> LocalRound:
        device = next(replica.model.parameters()).device
        return LocalRound(
            replica, compressor, TierSchedule(tiers=list(self.tiers), mode="all"),
            AdaptiveLimitsConfig(max_tokens=self.microbatch_tokens,
                                 max_examples=self.microbatch_examples,
                                 pad_to_multiple_of=self.pad_to_multiple_of).build(),
            self.steps,
            options=StepOptions(precision=Precision(self.precision, device),
                                data_parallel=parallel, seed=self.seed),
            row_length=self.row_length)


# Overlapped rounds (client/rounds.py): called after every inner step with the replica's
# weights (canonical name → tensor), it returns None, or, when the update the replica waits
# for has arrived, the replica's weights after it (applied exactly, hash checked), leaving
# the parameters as the training has them.
Advance = Callable[[dict[str, Tensor]], dict[str, Tensor] | None]


class LocalRound:
    """Runs rounds of local work on a replica; the error feedback (and under local steps
    the inner optimizer's state) persists across rounds.

    Without ``steps`` the result is the round's gradient. With ``steps`` the client takes
    one inner optimizer step per batch and the result is its pseudo-gradient, the weights
    before the round minus after; the replica's weights are then put back, since it moves
    only by the coordinator's broadcast (docs/architecture.md, "Local steps").

    With ``TierSchedule(mode="sample")`` the results still claim the region of the
    schedule's widest tier, so prefer ``mode="all"`` (weighted nested tiers) in a federated
    run.
    """

    def __init__(
        self,
        replica: Replica,
        compressor: Compressor | None,  # None: a data-parallel follower
        schedule: TierSchedule,
        limits: AdaptiveLimits | None = None,
        steps: LocalSteps | None = None,
        *,
        options: StepOptions | None = None,
        row_length: int | None = None,
    ) -> None:
        """``options``: precision and data parallelism of every step. ``row_length``: pack
        the sequences into rows of that many tokens (else one padded row each).
        ``compressor`` None: a data-parallel follower, which trains its share of each step
        and leaves the result (and the error feedback) to rank 0."""
        schedule.check(replica.config)  # every tier within the widths the replica holds
        self.replica = replica
        self.schedule = schedule
        self.steps = steps
        self.options = options or StepOptions()
        self.row_length = row_length
        self.runner = MicrobatchRunner(replica.model, limits or AdaptiveLimitsConfig().build())
        self.follower = compressor is None
        regions = trained_regions(replica.shapes, replica.config, schedule.tiers)
        self.feedback = FeedbackState(  # a follower's holds only its inner optimizer
            compressor, replica.shapes,
            {} if self.follower else {name: regions[name] for name in replica.parameters}
        )
        # the dtype of the gradient handed to error feedback
        self.dtype = torch.float32 if self.follower else compressor.momentum_dtype
        self.optimizer = self._fresh_optimizer()
        # under overlapped rounds, the weights' change in this client's last round: its
        # estimate of the update it waits for (see ``_local_steps``); None: no estimate
        self.lead: dict[str, Tensor] | None = None
        self.advance_s = 0.0  # applying updates inside the last round (not training)

    def run(self, sequences: Sequence[Tensor], step: int = 0, advance: Advance | None = None
            ) -> RoundWork:
        """The results of ``sequences`` (1-D token ids) at the schedule's tiers for ``step``
        (the round number), compressed with error feedback into one result per parameter.
        ``advance``: overlapped rounds under local steps (see ``_local_steps``)."""
        start = time.perf_counter()
        self.advance_s = 0.0
        tokens = sum(len(sequence) for sequence in sequences)
        if self.steps is None:
            rows = None
            if self.row_length is not None:
                rows = pack_rows([len(s) for s in sequences], self.row_length)
            losses = tier_gradients(self.runner, sequences, self.schedule, step, rows=rows,
                                    options=self.options)
            change = {name: p.grad for name, p in self.replica.parameters.items()}
        else:
            losses, change = self._local_steps(sequences, step, advance)
        results = []
        for name, parameter in self.replica.parameters.items():
            if self.follower:
                break  # rank 0 compresses the gradient every rank holds
            feedback = self.feedback[name]
            where = region_slices(feedback.region)
            grad = change[name]
            grad = torch.zeros_like(parameter[where]) if grad is None else grad[where]
            results.append(feedback.step(grad.to(self.dtype), tokens))
        self.replica.model.zero_grad(set_to_none=True)
        seconds = time.perf_counter() - start - self.advance_s
        return RoundWork(results=results, losses=losses, tokens=tokens, seconds=seconds)

    def _local_steps(self, sequences: Sequence[Tensor], step: int, advance: Advance | None
                     ) -> tuple[dict[str, float], dict[str, Tensor]]:
        """(loss per tier label, averaged over the batches by tokens; the pseudo-gradient
        per canonical name), the replica's weights left as they were, or as ``advance``
        moved them.

        The pseudo-gradient is the base the round trains from minus where it ends. Without
        ``advance`` the base is the replica's weights. With it (overlapped rounds: the
        replica lacks the update of the round before, which closes while this one trains)
        the base is the replica's weights plus ``lead``, this client's own change in its
        last round, the estimate of that update (eager updates); when the update arrives,
        between two inner steps, the base becomes the replica's new weights, exactly, and
        the steps taken so far move with it. So with one client at outer lr 1 the rounds
        train as if nothing were delayed, and with many only the clients' disagreement is
        late."""
        parameters = self.replica.parameters
        exact = {name: p.detach().clone() for name, p in parameters.items()}  # put back
        base = exact
        lead = self.lead if advance is not None else None
        if lead is not None and all(lead[n].shape == p.shape for n, p in parameters.items()):
            base = {name: exact[name] + lead[name] for name in parameters}
            with torch.no_grad():
                for name, parameter in parameters.items():
                    parameter.copy_(base[name])
        lengths, budget = [len(s) for s in sequences], self.steps.batch_tokens
        if self.row_length is None:
            plan = [[[i] for i in batch] for batch in plan_batches(
                lengths, budget, pad_to_multiple_of=self.runner.pad_to_multiple_of)]
        else:
            plan = plan_packed(lengths, budget, self.row_length)
        self.optimizer.scale_lr(self.steps.lr_scale(step))
        sums: dict[str, float] = {}
        for rows in plan:
            batch = [i for row in rows for i in row]
            examples = [sequences[i] for i in batch]
            local = {index: n for n, index in enumerate(batch)}
            losses = tier_gradients(self.runner, examples, self.schedule, step,
                                    rows=[[local[i] for i in row] for row in rows],
                                    positions=batch, options=self.options)
            if self.steps.grad_clip > 0:
                clip_gradient(self.replica.model, self.steps.grad_clip)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            weight = sum(len(example) for example in examples)
            for label, loss in losses.items():
                sums[label] = sums.get(label, 0.0) + loss * weight
            if advance is not None:
                paused = time.perf_counter()
                moved = advance(exact)
                if moved is not None:
                    with torch.no_grad():
                        for name, parameter in parameters.items():
                            parameter.add_(moved[name] - base[name])
                    exact = base = moved
                self.advance_s += time.perf_counter() - paused
        tokens = sum(len(sequence) for sequence in sequences)
        change = {}
        with torch.no_grad():
            for name, parameter in parameters.items():
                # in the feedback's dtype: float64 keeps the difference of float32s exact
                change[name] = base[name].to(self.dtype) - parameter.to(self.dtype)
                parameter.copy_(exact[name])
        if advance is not None:
            self.lead = {name: (-delta).to(parameters[name].dtype)
                         for name, delta in change.items()}
        return {label: total / tokens for label, total in sums.items()}, change

    def _fresh_optimizer(self) -> LocalOptimizer | None:
        return None if self.steps is None else self.steps.optimizer.build(self.replica.model)

    # -- state kept across rounds and restarts --------------------------------------------

    def save(self, path: Path) -> None:
        """The error feedback and the inner optimizer's state, atomically."""
        self.feedback.save(path, self.optimizer)

    def restore(self, path: Path) -> None:
        """Back to what ``save`` wrote (FeedbackStateMismatch if it does not fit, leaving
        the current state)."""
        self.feedback.load(path, self.optimizer)
        self.lead = None

    def reset(self) -> None:
        """Zero momentum and a fresh inner optimizer: a client's state before any round."""
        for state in self.feedback.feedback.values():
            state.momentum.zero_()
        self.optimizer = self._fresh_optimizer()
        self.lead = None
