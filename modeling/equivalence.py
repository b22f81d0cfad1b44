"""Check that batching changes nothing: a function on a batch equals a loop over examples.

Every padding or packing trick is one masking bug away from letting one example see another
(or see padding). ``assert_batch_equivalent`` is the first line of defence: it runs ``fn`` on
each example alone, as a batch of one with no padding, then on the batch, and compares each
example's slice of the batched output with its solo result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from matformer.modeling.batch import Batch, MaskedBatch


def assert_batch_equivalent(
    fn: Callable[[Tensor | Batch], Any],
    examples: Sequence[Tensor],
    make_batch: Callable[[Sequence[Tensor]], Batch] = MaskedBatch.from_list,
    *,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> Batch:
    """Raise AssertionError naming the first example whose batched result differs.

    ``fn`` takes a (1, T, ...) tensor or a batch and returns a (B, T, ...) tensor aligned with
    its input; ``make_batch`` builds the batch (for example ``lambda xs: PackedBatch.pack(xs,
    64)``). Example-level code run on a MaskedBatch may instead return a MaskedBatch, which is
    cut per example by its own mask (every position it keeps must be marked real), or a tuple
    of results. Returns the batch, for further checks.
    """
    batch = make_batch(examples)
    batched = _per_example(fn(batch), batch)
    for index, example in enumerate(examples):
        alone = _solo(fn(example.unsqueeze(0)))
        try:
            torch.testing.assert_close(batched[index], alone, atol=atol, rtol=rtol)
        except AssertionError as error:
            size = f"length {example.shape[0]}" if example.dim() else "a scalar"
            raise AssertionError(
                f"example {index} ({size}) differs when batched by "
                f"{type(batch).__name__}: {error}"
            ) from None
    return batch


def _per_example(output: Any, batch: Batch) -> list[Any]:
    """``output`` of ``fn(batch)`` as one result per example."""
    if isinstance(output, tuple | list):
        return list(zip(*(_per_example(part, batch) for part in output), strict=True))
    if not isinstance(output, MaskedBatch):
        return batch.unbatch(output)
    for index, mask in enumerate(output.example_masks()):
        if not bool(mask.all()):
            raise AssertionError(
                f"example {index}: the batched result marks part of the example as padding "
                f"(mask {mask.tolist()}), so some of its values were never computed for it.")
    return output.examples()


def _solo(output: Any) -> Any:
    """``output`` of ``fn`` on one example, without its batch dimension of one (a 0-d result,
    such as ``x.sum()``, is already the example's own)."""
    if isinstance(output, tuple | list):
        return tuple(_solo(part) for part in output)
    return output[0] if output.dim() else output
