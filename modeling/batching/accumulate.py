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

from matformer.modeling.batch import MaskedBatch, PackedBatch
from matformer.modeling.batching.cost import padded_tokens
from matformer.modeling.components.loss import IGNORE_INDEX
from matformer.modeling.devices import Precision
from matformer.modeling.errors import BatchError
from matformer.modeling.matformer import Tier
from matformer.modeling.models import TransformerWithLMHead


@dataclass(kw_only=True, slots=True)
class AccumulatedLoss:
    """What one batch's forward/backward passes did."""

    loss: float  # this share's Σ token losses over the batch's N target tokens
    targets: int  # positions that carried a loss (N above)
    tokens: int  # real tokens fed to the model
    padded_tokens: int  # tokens fed including padding, summed over the microbatches
    microbatches: int  # forward/backward passes run


@dataclass(frozen=True, slots=True)
class TrainingExamples:
    """Documents as a model trains on them: what it reads and the label of each position,
    drawn per document (a masked model's masks) before any batching, so that padding,
    packing, microbatching and the split over data-parallel ranks never change them."""

    inputs: list[Tensor]  # (T_i,) each
    labels: list[Tensor]  # (T_i,) each, IGNORE_INDEX where no loss
    targets: int  # positions that carry a loss, over all documents

    @classmethod
    def of(cls, model: TransformerWithLMHead, examples: Sequence[Tensor], *, seed: int = 0,
           positions: Sequence[int] | None = None) -> TrainingExamples:
        """``examples`` (1-D token ids) prepared by ``model.example_targets``. A masked
        model's draws for a document depend on ``seed`` and the document's position in its
        batch (``positions``, default 0, 1, ...) only."""
        positions = range(len(examples)) if positions is None else positions
        inputs, labels = [], []
        for position, example in zip(positions, examples, strict=True):
            generator = None
            if not model.config.is_causal:
                generator = torch.Generator().manual_seed(_draw_seed(seed, position))
            read, label = model.example_targets(example, generator)
            inputs.append(read)
            labels.append(label)
        targets = sum(int((label != IGNORE_INDEX).sum()) for label in labels)
        return cls(inputs, labels, targets)

    def __len__(self) -> int:
        return len(self.inputs)


def accumulate_gradients(
    model: TransformerWithLMHead,
    examples: Sequence[Tensor] | TrainingExamples,
    microbatches: Sequence[Sequence[int]],
    *,
    rows: Sequence[Sequence[int]] | None = None,
    tier: Tier | None = None,
    weight: float = 1.0,
    pad_value: int = 0,
    targets: int | None = None,
    precision: Precision | None = None,
    pad_to_multiple_of: int = 1,
) -> AccumulatedLoss:
    """Forward/backward each microbatch, adding ``weight`` × the batch's mean-loss gradient.

    ``examples`` are 1-D token-id tensors (or already ``TrainingExamples``). Without
    ``rows`` each example is a padded row and ``microbatches`` index the examples; with
    ``rows`` (index lists into the examples, as ``pack_rows`` gives them) each row packs
    its examples end to end and ``microbatches`` index the rows. Either way they must use
    each exactly once. ``targets`` is the divisor of the mean when this is one share of a
    larger batch (data parallelism); by default the examples' own. ``precision`` runs the
    forward passes under autocast and scales the loss (fp16). Each microbatch's rows are
    padded up to a multiple of ``pad_to_multiple_of``.

    Gradients add to whatever ``.grad`` holds, so clear them first (as an optimizer step's
    ``zero_grad`` does). ``weight`` is a tier's loss weight, as ``TierSchedule.step_tiers``
    gives it.
    """
    if not isinstance(examples, TrainingExamples):
        examples = TrainingExamples.of(model, examples)
    rows = [[i] for i in range(len(examples))] if rows is None else [list(r) for r in rows]
    _check_partition(microbatches, len(rows))
    packed = any(len(row) > 1 for row in rows)
    targets = examples.targets if targets is None else targets
    if targets == 0:
        raise BatchError(
            "no example has a target token (each has a single token); batch sequences of "
            "at least two tokens."
        )
    precision = precision or Precision()
    scale = weight * precision.scale / targets
    sizes = [sum(len(examples.inputs[i]) for i in row) for row in rows]
    total = torch.zeros((), device=examples.inputs[0].device)
    for microbatch in microbatches:
        batch, labels = _layout(examples, [rows[r] for r in microbatch], packed, pad_value,
                                pad_to_multiple_of)
        with precision.autocast():
            loss = model.labelled_loss(batch, labels, tier=tier, reduction="sum")  # Σ, fp32
        (loss * scale).backward()
        total += loss.detach()  # summed on device: no sync per microbatch
    return AccumulatedLoss(
        loss=total.item() / targets,
        targets=targets,
        tokens=sum(sizes),
        padded_tokens=sum(padded_tokens([sizes[r] for r in mb], pad_to_multiple_of)
                          for mb in microbatches),
        microbatches=len(microbatches),
    )


def _layout(examples: TrainingExamples, rows: list[list[int]], packed: bool, pad_value: int,
            multiple: int = 1) -> tuple[MaskedBatch | PackedBatch, Tensor]:
    """One microbatch's batch and (B, T) labels: padded rows, or packed ones, each row
    padded up to a ``multiple``."""
    order = [i for row in rows for i in row]
    inputs = [examples.inputs[i] for i in order]
    labels = [examples.labels[i] for i in order]
    if not packed:
        return (MaskedBatch.from_list(inputs, pad_value=pad_value, pad_to_multiple_of=multiple),
                MaskedBatch.from_list(labels, pad_value=IGNORE_INDEX,
                                      pad_to_multiple_of=multiple).data)
    local, start = [], 0
    for row in rows:
        local.append(list(range(start, start + len(row))))
        start += len(row)
    return (PackedBatch.from_rows(inputs, local, pad_value=pad_value,
                                  pad_to_multiple_of=multiple),
            PackedBatch.from_rows(labels, local, pad_value=IGNORE_INDEX,
                                  pad_to_multiple_of=multiple).data)


def _draw_seed(seed: int, position: int) -> int:
    return (seed * 1_000_003 + position) % (1 << 63)


def _check_partition(microbatches: Sequence[Sequence[int]], count: int) -> None:
    """Raise BatchError unless ``microbatches`` use each of ``count`` rows exactly once."""
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
