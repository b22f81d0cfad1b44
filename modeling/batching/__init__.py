"""Token-budget batching: batches sized in tokens, split into microbatches that fit memory.

Every budget counts *padded* tokens, rows × longest row (``cost.py`` says why). A typical
loop, one optimizer step per batch::

    from modeling.batching import AdaptiveLimitsConfig, MicrobatchRunner, plan_batches

    runner = MicrobatchRunner(model, AdaptiveLimitsConfig(max_tokens=4096).build())
    for indices in plan_batches(lengths, max_tokens=16384):
        result = runner.accumulate([dataset[i] for i in indices])  # gradients, retried on OOM
        optimizer.step()
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
