"""Token-budget batching: batches sized in tokens, split into microbatches that fit memory.

Every budget counts *padded* tokens, rows × longest row (``cost.py`` says why). A typical
loop, one optimizer step per batch::

    from modeling.batching import AdaptiveLimitsConfig, MicrobatchRunner, plan_batches

    runner = MicrobatchRunner(model, AdaptiveLimitsConfig(max_tokens=4096).build())
    for indices in plan_batches(lengths, max_tokens=16384):
        result = runner.accumulate([dataset[i] for i in indices])  # gradients, retried on OOM
        optimizer.step()

Public API:

plan_batches(lengths, max_tokens, *, sort_window=16) -> list[list[int]]
    Batches of indices, each padding to ≤ max_tokens, sorted by length within windows of
    sort_window batches' worth of consecutive sequences; sort_window=0 keeps data order
    (plan.py).
split_microbatches(lengths, *, max_tokens, max_examples) -> list[list[int]]
    One batch cut into microbatches, longest rows first (microbatches.py).
padded_tokens(lengths) -> int
    rows × longest: what a padded batch of these lengths holds (cost.py).
accumulate_gradients(model, examples, microbatches, *, tier=None, weight=1.0, pad_value=0)
    -> AccumulatedLoss
    Forward/backward per microbatch, scaled so the gradients sum to the full batch's
    (accumulate.py).
AdaptiveLimitsConfig(...).build() -> AdaptiveLimits; MicrobatchLimits; length_regime(longest)
    Per-length-regime microbatch limits that shrink on out-of-memory and grow back after
    stable steps, with no torch dependency (limits.py).
MicrobatchRunner(model, limits).accumulate(examples, *, tier=None, pad_value=0)
    -> AccumulatedLoss; .run(lengths, attempt)
    Plan with the regime's limits, accumulate, and on torch.OutOfMemoryError clear the
    gradients, shrink and retry the same batch (runner.py).

Errors (modeling.errors): SequenceTooLong (one sequence exceeds a token budget),
BatchDoesNotFit (out of memory at the smallest limits), BatchError (microbatches that do not
use each example once), ConfigError (invalid limits).
"""

from modeling.batching.accumulate import AccumulatedLoss, accumulate_gradients
from modeling.batching.cost import padded_tokens
from modeling.batching.limits import (
    AdaptiveLimits,
    AdaptiveLimitsConfig,
    MicrobatchLimits,
    length_regime,
)
from modeling.batching.microbatches import split_microbatches
from modeling.batching.plan import plan_batches
from modeling.batching.runner import MicrobatchRunner

__all__ = [
    "AccumulatedLoss",
    "AdaptiveLimits",
    "AdaptiveLimitsConfig",
    "MicrobatchLimits",
    "MicrobatchRunner",
    "accumulate_gradients",
    "length_regime",
    "padded_tokens",
    "plan_batches",
    "split_microbatches",
]
