"""Gradient accumulation over microbatches that equals one full-batch backward pass.

The full batch's loss is the mean over its N target tokens: (1/N) Σ token losses. Each
microbatch therefore backpropagates its *sum* of token losses divided by the whole batch's
N, not its own mean: the per-microbatch gradients then add up to the full-batch gradient,
to fp32 round-off, however the batch is split. (Averaging microbatch means would weight a
token in a small microbatch more than one in a large microbatch.)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from modeling.batch import MaskedBatch
from modeling.batching.cost import padded_tokens
from modeling.errors import BatchError
from modeling.matformer import Tier
from modeling.models import AutoregressiveModel


@dataclass(kw_only=True, slots=True)
class AccumulatedLoss:
    """What one batch's forward/backward passes did."""

    loss: float  # mean loss per target token over the whole batch (the full batch's loss)
    targets: int  # positions that carried a loss (N above)
    tokens: int  # real tokens fed to the model
    padded_tokens: int  # tokens fed including padding, summed over the microbatches
    microbatches: int  # forward/backward passes run


def accumulate_gradients(
    model: AutoregressiveModel,
    examples: Sequence[Tensor],
    microbatches: Sequence[Sequence[int]],
    *,
    tier: Tier | None = None,
    weight: float = 1.0,
    pad_value: int = 0,
) -> AccumulatedLoss:
    """Forward/backward each microbatch, adding ``weight`` × the batch's mean-loss gradient.

    ``examples`` are 1-D token-id tensors; ``microbatches`` are index lists into them that
    must use every example exactly once. Gradients add to whatever ``.grad`` holds, so clear
    them first (as an optimizer step's ``zero_grad`` does). ``weight`` is a tier's loss
    weight, as ``TierSchedule.step_tiers`` gives it.
    """
    _check_partition(microbatches, len(examples))
    batches = [
        MaskedBatch.from_list([examples[i] for i in indices], pad_value=pad_value)
        for indices in microbatches
    ]
    targets = sum(model.num_targets(batch) for batch in batches)
    if targets == 0:
        raise BatchError(
            "no example has a target token (each has a single token); batch sequences of "
            "at least two tokens."
        )
    total = torch.zeros((), device=batches[0].data.device)
    for batch in batches:
        loss = model.loss(batch, tier=tier, reduction="sum")  # Σ token losses, fp32
        (loss * (weight / targets)).backward()
        total += loss.detach()  # summed on device: no sync per microbatch
    lengths = [len(example) for example in examples]
    return AccumulatedLoss(
        loss=total.item() / targets,
        targets=targets,
        tokens=sum(lengths),
        padded_tokens=sum(padded_tokens([lengths[i] for i in mb]) for mb in microbatches),
        microbatches=len(batches),
    )


def _check_partition(microbatches: Sequence[Sequence[int]], count: int) -> None:
    """Raise BatchError unless ``microbatches`` use each of ``count`` examples exactly once."""
    uses = Counter(i for indices in microbatches for i in indices)
    empty = sum(not indices for indices in microbatches)
    if not empty and sorted(uses.elements()) == list(range(count)):
        return
    raise BatchError(
        f"microbatches must use each of the {count} examples exactly once; missing "
        f"{sorted(set(range(count)) - uses.keys())}, repeated "
        f"{sorted(i for i, n in uses.items() if n > 1)}, out of range "
        f"{sorted(i for i in uses if not 0 <= i < count)}, {empty} empty. Split the batch "
        "with split_microbatches."
    )
