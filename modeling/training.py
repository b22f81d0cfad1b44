"""One local training step over one or several MatFormer tiers.

Two recipes: ``all`` trains every listed tier on the same batch and sums their losses with
weights (the MatFormer paper's public code); ``sample`` draws one tier per step with given
probabilities (the paper's own recipe). Each tier's loss is backpropagated as soon as it is
computed, which frees its graph and gives the same gradient as backpropagating the sum.

``tier_gradients`` takes the sequences of a token-budget batch and accumulates their
gradient in microbatches that adapt to out-of-memory errors; ``train_step_on_examples`` adds
the optimizer step.
``with_targets`` keeps the sequences that can train at all: a batch with no target token
cannot (BatchError), so standalone and federated training plan only those.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from matformer.modeling.batch import MaskedBatch
from matformer.modeling.batching import MicrobatchRunner, accumulate_gradients, split_microbatches
from matformer.modeling.batching.accumulate import TrainingExamples
from matformer.modeling.components.loss import IGNORE_INDEX
from matformer.modeling.config import ModelConfig
from matformer.modeling.devices import Precision
from matformer.modeling.distributed import DataParallel
from matformer.modeling.errors import BatchDoesNotFit, BatchError, ConfigError
from matformer.modeling.matformer import Tier, layer_widths, tier_label
from matformer.modeling.models import TransformerWithLMHead
from matformer.modeling.optim import LocalOptimizer

MODES = ("all", "sample")


@dataclass(kw_only=True, slots=True)
class TierSchedule:
    """Which tiers each training step trains, and how their losses combine."""

    tiers: list[Tier] = field(default_factory=lambda: [0])  # tiers or Mix'n'Match lists
    mode: str = "all"  # "all": every tier each step | "sample": one tier per step
    weights: list[float] | None = None  # "all": loss weight per tier (default 1 each)
    probabilities: list[float] | None = None  # "sample": draw probability per tier (uniform)
    seed: int = 0  # makes the "sample" draws reproducible
    # per-layer mixes of the integer tiers drawn each step besides them (widths never growing
    # with depth), so that the model learns Mix'n'Match slices as well as uniform ones
    mixes: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"tier schedule mode {self.mode!r} is not one of {MODES}.")
        if not self.tiers:
            raise ConfigError("a tier schedule needs at least one tier.")
        for name in ("weights", "probabilities"):
            values = getattr(self, name)
            if values is None:
                continue
            if len(values) != len(self.tiers):
                raise ConfigError(
                    f"{name} has {len(values)} entries for {len(self.tiers)} tiers; give one each."
                )
            if any(v < 0 for v in values) or sum(values) <= 0:
                raise ConfigError(f"{name} must be non-negative and not all zero, got {values}.")
        if self.mixes < 0:
            raise ConfigError(f"mixes must be >= 0, got {self.mixes}.")
        if self.mixes and len({t for t in self.tiers if isinstance(t, int)}) < 2:
            raise ConfigError("drawing per-layer mixes needs two integer tiers or more to mix.")

    def check(self, config: Any) -> None:
        """Raise TierError if some tier cannot run on a model with ``config``."""
        for tier in self.tiers:
            layer_widths(config, tier)

    def step_tiers(self, step: int, layers: int = 0) -> list[tuple[Tier, float]]:
        """(tier, loss weight) pairs to train at ``step`` (``layers``: the model's, the
        length of a drawn mix)."""
        draw = random.Random(f"{self.seed}:{step}")
        if self.mode == "all":
            weights = self.weights or [1.0] * len(self.tiers)
            chosen = [(t, w) for t, w in zip(self.tiers, weights, strict=True) if w > 0]
        else:
            chosen = [(draw.choices(self.tiers, weights=self.probabilities)[0], 1.0)]
        return chosen + [(mix, 1.0) for mix in self.drawn_mixes(draw, layers)]

    def drawn_mixes(self, draw: random.Random, layers: int) -> list[list[int]]:
        """``mixes`` per-layer lists of the integer tiers, each sorted (no layer wider than
        the one before), none uniform where there are two layers or more: those are trained
        as tiers already."""
        if not self.mixes:
            return []
        if layers < 1:
            raise ConfigError("drawing per-layer mixes needs the model's layer count.")
        tiers = sorted({t for t in self.tiers if isinstance(t, int)})
        drawn: list[list[int]] = []
        while len(drawn) < self.mixes:
            mix = sorted(draw.choice(tiers) for _ in range(layers))
            if len(set(mix)) > 1 or layers == 1:
                drawn.append(mix)
        return drawn


@dataclass(kw_only=True, slots=True)
class StepOptions:
    """How every training step runs, whatever its batch."""

    precision: Precision = field(default_factory=Precision)  # autocast and fp16 loss scale
    data_parallel: DataParallel | None = None  # this process's share of each batch, if any
    seed: int = 0  # of the masks a masked model draws per document


def tier_gradients(
    runner: MicrobatchRunner,
    examples: Sequence[Tensor],
    schedule: TierSchedule,
    step: int,
    *,
    rows: Sequence[Sequence[int]] | None = None,
    positions: Sequence[int] | None = None,
    options: StepOptions | None = None,
) -> dict[str, float]:
    """Accumulate the gradient of ``examples`` (1-D token ids of any lengths) at the step's
    tiers into ``.grad``; the loss per tier label. No optimizer step: standalone training
    takes one (``train_step_on_examples``), a federated client compresses the gradient.

    ``rows`` packs the examples (index lists, from ``pack_rows``); without it each example
    is a padded row. Each tier's gradient is accumulated over microbatches of rows sized by
    the runner's limits and equals that of the whole batch at once; after an out-of-memory
    error the runner clears the gradients and retries every tier with smaller microbatches.
    ``positions`` number the examples for a masked model's draws (default 0, 1, ...): give
    each document of a round a position of its own when the round takes several steps.

    Under data parallelism this rank trains its share of the rows and the gradients and
    losses are summed over the ranks: every rank ends with the whole batch's gradient. An
    fp16 gradient that overflowed is computed again at half the loss scale.
    """
    options = options or StepOptions()
    model, parallel = runner.model, options.data_parallel
    rows = [[i] for i in range(len(examples))] if rows is None else [list(r) for r in rows]
    packed = any(len(row) > 1 for row in rows)
    if parallel is not None:
        rows = [rows[r] for r in parallel.share([sum(len(examples[i]) for i in row)
                                                 for row in rows])]
    mine = sorted(i for row in rows for i in row)
    local = {index: position for position, index in enumerate(mine)}
    rows = [[local[i] for i in row] for row in rows]
    prepared = TrainingExamples.of(
        model, [examples[i] for i in mine], seed=options.seed * 1_000_003 + step,
        positions=mine if positions is None else [positions[i] for i in mine])
    targets = prepared.targets
    if parallel is not None:
        targets = int(parallel.sum_(torch.tensor([targets], device=parallel.device)).item())
    tiers = schedule.step_tiers(step, runner.model.config.num_hidden_layers)

    def attempt(plan: list[list[int]]) -> dict[str, float]:
        return {
            tier_label(tier): accumulate_gradients(
                model, prepared, plan, rows=rows if packed else None, tier=tier,
                weight=weight, targets=targets, precision=options.precision,
                pad_to_multiple_of=runner.pad_to_multiple_of).loss
            for tier, weight in tiers
        }

    sizes = [sum(len(prepared.inputs[i]) for i in r) for r in rows]
    while True:
        if parallel is not None and parallel.sharded:
            losses = _lockstep(runner, parallel, sizes, attempt, tiers, examples[0])
        elif rows:
            losses = runner.run(sizes, attempt)
        else:  # a data-parallel share with nothing in it: this rank adds zeros
            model.zero_grad(set_to_none=True)
            losses = {tier_label(tier): 0.0 for tier, _ in tiers}
        if parallel is not None:
            if not parallel.sharded:  # FSDP summed them during backward
                parallel.sum_gradients(model)
            summed = parallel.sum_(torch.tensor(list(losses.values()), dtype=torch.float64,
                                                device=parallel.device))
            losses = dict(zip(losses, summed.tolist(), strict=True))
        if options.precision.unscale(model.parameters()):
            return losses


def _lockstep(runner: MicrobatchRunner, parallel: DataParallel, sizes: list[int],
              attempt: Callable[[list[list[int]]], dict[str, float]],
              tiers: list[tuple[Tier, float]], sample: Tensor) -> dict[str, float]:
    """A sharded step's passes: this rank's microbatches, then passes that add nothing until
    it has run as many as the busiest rank, at every tier; each gathers and reduces with
    the others. The limits stay fixed: an out-of-memory error on one rank cannot be retried
    without the others, so it ends the run with what to lower."""
    model = runner.model
    model.zero_grad(set_to_none=True)
    plan = []
    if sizes:
        limits = runner.limits.limits(max(sizes))
        plan = split_microbatches(sizes, max_tokens=limits.max_tokens,
                                  max_examples=limits.max_examples,
                                  pad_to_multiple_of=runner.pad_to_multiple_of)
    idle = parallel.most(len(plan)) - len(plan)
    try:
        losses = attempt(plan) if plan else {tier_label(t): 0.0 for t, _ in tiers}
        pad = sample[:2].new_zeros(2)
        for tier, _ in tiers:
            for _ in range(idle):
                (model.labelled_loss(MaskedBatch.from_list([pad]), torch.full_like(
                    pad, IGNORE_INDEX)[None], tier=tier, reduction="sum") * 0.0).backward()
    except torch.OutOfMemoryError as error:
        raise BatchDoesNotFit(
            f"a microbatch ran out of memory under --fsdp, where microbatches cannot shrink "
            f"on one rank alone; lower --microbatch-tokens (now {runner.limits.limits(1)})."
        ) from error
    return losses


def train_step_on_examples(
    runner: MicrobatchRunner,
    optimizer: LocalOptimizer | torch.optim.Optimizer,
    examples: Sequence[Tensor],
    schedule: TierSchedule,
    step: int,
    max_grad_norm: float | None = None,
    *,
    rows: Sequence[Sequence[int]] | None = None,
    options: StepOptions | None = None,
    stats: dict[str, float] | None = None,
) -> dict[str, float]:
    """One optimizer step over ``examples`` at the step's tiers (``tier_gradients``, then
    clipping to ``max_grad_norm`` when given); the loss per tier label. ``stats``, when
    given, receives ``grad_norm``: the gradient's norm before clipping."""
    losses = tier_gradients(runner, examples, schedule, step, rows=rows, options=options)
    if max_grad_norm is not None:
        norm = clip_gradient(runner.model, max_grad_norm)
        if stats is not None:
            stats["grad_norm"] = norm
    optimizer.step()
    return losses


def clip_gradient(model: torch.nn.Module, max_norm: float) -> float:
    """Scale ``model``'s gradient to a norm of at most ``max_norm`` (over every parameter
    together, sharded ones too); its norm before."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)


@torch.no_grad()
def held_out_loss(
    model: TransformerWithLMHead,
    examples: Sequence[Tensor],
    tiers: Sequence[Tier],
    *,
    batch_tokens: int,
    max_examples: int | None = None,
    precision: Precision | None = None,
    seed: int = 0,
) -> dict[str, float]:
    """Mean loss per target token of ``examples`` at each tier, in padded microbatches of at
    most ``batch_tokens`` tokens (and ``max_examples`` rows); a microbatch that runs out of
    memory is split in two and each half run, down to single sequences. A masked model's
    masks are drawn from ``seed``, the same at every tier and every call. The model is left
    in the mode it was in."""
    precision = precision or Precision()
    prepared = TrainingExamples.of(model, examples, seed=seed)
    plan = split_microbatches([len(e) for e in examples], max_tokens=batch_tokens,
                              max_examples=max_examples or len(examples))
    training = model.training
    model.eval()
    losses = {}
    for tier in tiers:
        total = sum(_summed_loss(model, prepared, rows, tier, precision) for rows in plan)
        losses[tier_label(tier)] = total / prepared.targets
    model.train(training)
    return losses


def _summed_loss(model: TransformerWithLMHead, prepared: TrainingExamples, rows: list[int],
                 tier: Tier, precision: Precision) -> float:
    """Σ token losses of ``rows`` at ``tier``; halves and retries after out of memory."""
    try:
        batch = MaskedBatch.from_list([prepared.inputs[i] for i in rows])
        labels = MaskedBatch.from_list([prepared.labels[i] for i in rows],
                                       pad_value=IGNORE_INDEX).data
        with precision.autocast():
            return model.labelled_loss(batch, labels, tier=tier, reduction="sum").item()
    except torch.OutOfMemoryError as error:
        error = error.with_traceback(None)  # free the failed pass's activations
        if len(rows) == 1:
            raise BatchDoesNotFit(
                f"one sequence of {len(prepared.inputs[rows[0]])} tokens does not fit in "
                "memory for evaluation; use a shorter sequence length or a larger device."
            ) from error
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    half = len(rows) // 2
    return (_summed_loss(model, prepared, rows[:half], tier, precision)
            + _summed_loss(model, prepared, rows[half:], tier, precision))


def target_tokens(config: ModelConfig) -> int:
    """Fewest tokens a sequence needs to carry a target for a model of ``config``: a causal
    model's last token predicts nothing, so it needs two; a masked model can mask any one."""
    return 2 if config.is_causal else 1


def with_targets(ids: np.ndarray, lengths: np.ndarray, config: ModelConfig,
                 responses: np.ndarray | None = None) -> np.ndarray:
    """The ``ids``, in their order, whose sequences carry a target for a model of ``config``
    (``lengths[i]``: tokens of sequence ``i``; of instruction data, ``responses[i]``: its
    response tokens after the first, as ``SequenceReader.response_lengths`` gives them, so
    that a sequence of prompt alone is left out too). Raises BatchError if none does."""
    needed = target_tokens(config)
    trainable = lengths[ids] >= needed
    if responses is not None:
        trainable &= responses[ids] > 0
    kept = ids[trainable]
    if not len(kept) and responses is not None:
        raise BatchError(f"none of the {len(ids):,} sequences holds a response token after its "
                         "first, so nothing can train; give conversations with responses, or "
                         "a longer sequence length if long prompts fill them.")
    if not len(kept):
        raise BatchError(f"none of the {len(ids):,} sequences has the {needed} tokens a target "
                         "needs, so nothing can train; give data with longer documents.")
    return kept
