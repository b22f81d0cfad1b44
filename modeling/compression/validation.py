"""Checks on a sparse result from the wire, before it touches any aggregate.

A result is checked once: ``validate`` returns it as a ``ValidResult``, which is checked
when it is made (``dataclasses.replace`` makes one too), and which every later ``validate``
takes as it is. The wire's decoder validates what it reads, so the submission gate and the
aggregation take the decoded results without checking them again.

Every failure is a ``CompressionError`` subclass whose message names the parameter and the
field, so the coordinator can answer INVALID_ARGUMENT with it as it stands.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from matformer.modeling.compression.encodings import get_encoding
from matformer.modeling.compression.sparse import SparseResult
from matformer.modeling.errors import BadTokenCount, NonFiniteValues, ResultShapeMismatch


@dataclasses.dataclass(frozen=True, slots=True)
class ValidResult(SparseResult):
    """A ``SparseResult`` known to decode to what it claims: checked when it is made."""

    def __post_init__(self) -> None:
        _check(self)


def validate(result: SparseResult) -> ValidResult:
    """``result`` as a ``ValidResult``; the matching CompressionError unless it decodes to
    what it claims. A ``ValidResult`` is returned as it is: it was checked when made."""
    if isinstance(result, ValidResult):
        return result
    return ValidResult(**{f.name: getattr(result, f.name)
                          for f in dataclasses.fields(SparseResult)})


def _check(result: SparseResult) -> None:
    """Common fields here, the encoding's own layout in its ``check``."""
    encoding = get_encoding(result.encoding)  # raises UnknownEncoding
    name = result.name
    if isinstance(result.tokens, bool) or not isinstance(result.tokens, int) or result.tokens < 1:
        raise BadTokenCount(
            f"{name}: tokens must be a positive integer (the tokens behind the gradient), "
            f"got {result.tokens!r}."
        )
    if any(not isinstance(n, int) or n < 1 for n in result.shape):
        raise ResultShapeMismatch(f"{name}: shape {result.shape} must be positive integers.")
    encoding.check(result)
    values = result.values
    if not values.dtype.is_floating_point:
        raise ResultShapeMismatch(f"{name}: values must be floating point, got {values.dtype}.")
    if not all_finite(values):
        raise NonFiniteValues(
            f"{name}: values hold NaN or infinity; the client's gradient diverged, so drop "
            "this result and have the client resynchronize."
        )


def all_finite(tensor: Tensor) -> bool:
    """Whether every element of ``tensor`` is finite, in one read: the sum is finite
    whenever every element is, unless it overflows, and then they are checked one by one."""
    return bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all())


def validate_group(results: Sequence[SparseResult]) -> list[ValidResult]:
    """Each result validated (once: see the module), all for one parameter of one universal
    shape."""
    valid = [validate(result) for result in results]
    for result in results[1:]:
        if (result.name, result.shape) != (results[0].name, results[0].shape):
            raise ResultShapeMismatch(
                f"results for one aggregation disagree: {result.name} {result.shape} against "
                f"{results[0].name} {results[0].shape}; aggregate each parameter on its own."
            )
    return valid
