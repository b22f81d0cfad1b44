"""Token-budget batching: batches sized in tokens, split into microbatches that fit memory.

Every budget counts *padded* tokens, rows × longest row (``cost.py`` says why). Batches
are padded (``plan_batches``: one sequence a row) or packed (``plan_packed``: sequences end
to end in rows of a fixed length, almost no padding). A typical loop, one optimizer step
per batch::

    from matformer.modeling.batching import AdaptiveLimitsConfig, MicrobatchRunner, plan_batches

    runner = MicrobatchRunner(model, AdaptiveLimitsConfig(max_tokens=4096).build())
    for indices in plan_batches(lengths, max_tokens=16384):
        result = runner.accumulate([dataset[i] for i in indices])  # gradients, retried on OOM
        optimizer.step()
"""

from matformer.modeling.batching.accumulate import (
    AccumulatedLoss,
    TrainingExamples,
    accumulate_gradients,
)
from matformer.modeling.batching.cost import padded_tokens
from matformer.modeling.batching.limits import (
    AdaptiveLimits,
    AdaptiveLimitsConfig,
    MicrobatchLimits,
    length_regime,
)
from matformer.modeling.batching.microbatches import split_microbatches
from matformer.modeling.batching.pack import pack_rows, plan_packed
from matformer.modeling.batching.plan import plan_batches
from matformer.modeling.batching.runner import MicrobatchRunner

__all__ = [
    "AccumulatedLoss",
    "AdaptiveLimits",
    "AdaptiveLimitsConfig",
    "MicrobatchLimits",
    "MicrobatchRunner",
    "TrainingExamples",
    "accumulate_gradients",
    "length_regime",
    "pack_rows",
    "padded_tokens",
    "plan_batches",
    "plan_packed",
    "split_microbatches",
]
