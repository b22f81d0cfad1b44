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

from matformer.modeling.compression.encodings import Encoding, get_encoding
from matformer.modeling.compression.sparse import SparseResult
from matformer.modeling.errors import (
    BadTokenCount,
    CompressionError,
    NonFiniteValues,
    ResultShapeMismatch,
)


@dataclasses.dataclass(frozen=True, slots=True)
class ValidResult(SparseResult):
    """A ``SparseResult`` known to decode to what it claims: checked when it is made."""

    def __post_init__(self) -> None:
        _check(self)


_FIELDS = tuple(f.name for f in dataclasses.fields(SparseResult))


def validate(result: SparseResult) -> ValidResult:
    """``result`` as a ``ValidResult``; the matching CompressionError unless it decodes to
    what it claims. A ``ValidResult`` is returned as it is: it was checked when made."""
    if isinstance(result, ValidResult):
        return result
    return ValidResult(**{name: getattr(result, name) for name in _FIELDS})


def validate_all(results: Sequence[SparseResult]) -> list[ValidResult]:
    """``validate`` of each result, the same checks read once over all of them where they
    can be (``Encoding.all_valid``, and one finite check per values dtype): a submission's
    hundred results cost a few reads each, where one at a time they cost a few dozen small
    ones. When anything fails, each result is validated on its own, which raises what
    ``validate`` raises for the first bad one."""
    if not _all_valid(results):
        return [validate(result) for result in results]
    return [result if isinstance(result, ValidResult) else _checked(result)
            for result in results]


def _all_valid(results: Sequence[SparseResult]) -> bool:
    by_encoding: dict[str, list[SparseResult]] = {}
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for result in results:
        try:
            _check_fields(result)
        except CompressionError:
            return False
        if not result.values.dtype.is_floating_point:
            return False
        by_encoding.setdefault(result.encoding, []).append(result)
        by_dtype.setdefault(result.values.dtype, []).append(result.values.reshape(-1))
    return (all(get_encoding(name).all_valid(group) for name, group in by_encoding.items())
            and all(all_finite(torch.cat(values)) for values in by_dtype.values()))


def _checked(result: SparseResult) -> ValidResult:
    """``result`` as a ValidResult without checking it again (``validate_all`` just did)."""
    made = object.__new__(ValidResult)
    for name in _FIELDS:
        object.__setattr__(made, name, getattr(result, name))
    return made


def _check(result: SparseResult) -> None:
    """Common fields here, the encoding's own layout in its ``check``."""
    encoding = _check_fields(result)
    encoding.check(result)
    values = result.values
    if not values.dtype.is_floating_point:
        raise ResultShapeMismatch(f"{result.name}: values must be floating point, got "
                                  f"{values.dtype}.")
    if not all_finite(values):
        raise NonFiniteValues(
            f"{result.name}: values hold NaN or infinity; the client's gradient diverged, so "
            "drop this result and have the client resynchronize."
        )


def _check_fields(result: SparseResult) -> Encoding:
    """The result's encoding, once it is known and the tokens and shape are well formed."""
    encoding = get_encoding(result.encoding)  # raises UnknownEncoding
    name = result.name
    if isinstance(result.tokens, bool) or not isinstance(result.tokens, int) or result.tokens < 1:
        raise BadTokenCount(
            f"{name}: tokens must be a positive integer (the tokens behind the gradient), "
            f"got {result.tokens!r}."
        )
    if any(not isinstance(n, int) or n < 1 for n in result.shape):
        raise ResultShapeMismatch(f"{name}: shape {result.shape} must be positive integers.")
    return encoding


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
