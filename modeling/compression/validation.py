"""Checks on a sparse result from the wire, before it touches any aggregate.

Every failure is a ``CompressionError`` subclass whose message names the parameter and the
field, so the coordinator can answer INVALID_ARGUMENT with it as it stands.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from matformer.modeling.compression.encodings import get_encoding
from matformer.modeling.compression.sparse import SparseResult
from matformer.modeling.errors import BadTokenCount, NonFiniteValues, ResultShapeMismatch


def validate(result: SparseResult) -> None:
    """Raise the matching CompressionError unless ``result`` decodes to what it claims: common
    fields here, the encoding's own layout in its ``check``."""
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
    if not torch.isfinite(values).all():
        raise NonFiniteValues(
            f"{name}: values hold NaN or infinity; the client's gradient diverged, so drop "
            "this result and have the client resynchronize."
        )


def validate_group(results: Sequence[SparseResult]) -> None:
    """Validate each result, and that all are for one parameter of one universal shape."""
    for result in results:
        validate(result)
    for result in results[1:]:
        if (result.name, result.shape) != (results[0].name, results[0].shape):
            raise ResultShapeMismatch(
                f"results for one aggregation disagree: {result.name} {result.shape} against "
                f"{results[0].name} {results[0].shape}; aggregate each parameter on its own."
            )
