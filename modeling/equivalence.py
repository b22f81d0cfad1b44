"""Check that batching changes nothing: a function on a batch equals a loop over examples.

Every padding or packing trick is one masking bug away from letting one example see another
(or see padding). ``assert_batch_equivalent`` is the first line of defence: it runs ``fn`` on
each example alone, as a batch of one with no padding, then on the batch, and compares each
example's slice of the batched output with its solo result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from matformer.modeling.batch import Batch, MaskedBatch


def assert_batch_equivalent(
    fn: Callable[[Tensor | Batch], Tensor],
    examples: Sequence[Tensor],
    make_batch: Callable[[Sequence[Tensor]], Batch] = MaskedBatch.from_list,
    *,
    atol: float = 1e-5,
    rtol: float = 1e-4,
) -> Batch:
    """Raise AssertionError naming the first example whose batched result differs.

    ``fn`` takes a (1, T, ...) tensor or a batch and returns a (B, T, ...) tensor aligned with
    its input; ``make_batch`` builds the batch (for example ``lambda xs: PackedBatch.pack(xs,
    64)``). Returns the batch, for further checks.
    """
    batch = make_batch(examples)
    batched = batch.unbatch(fn(batch))
    for index, example in enumerate(examples):
        alone = fn(example.unsqueeze(0))[0]
        try:
            torch.testing.assert_close(batched[index], alone, atol=atol, rtol=rtol)
        except AssertionError as error:
            raise AssertionError(
                f"example {index} (length {example.shape[0]}) differs when batched by "
                f"{type(batch).__name__}: {error}"
            ) from None
    return batch
