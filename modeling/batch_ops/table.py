"""The op table: which handler runs a torch function or Tensor method on a MaskedBatch.

A handler receives the torch callable and its arguments as torch passed them and returns the
result, usually a new MaskedBatch. Most handlers call the original callable on the padded
``data`` and then say what the result's mask is; a few first overwrite the padding with a value
that cannot change the result (0 for a sum, -inf for a softmax or a max). A new op is a new
entry here, made with ``@implements``, never a branch in ``MaskedBatch``.

Dimensions are counted as in example-level code at batch size one: dimension 0 is the batch
dimension, dimension ``d >= 1`` is the example's own dimension ``d``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from matformer.modeling.batch import MaskedBatch
from matformer.modeling.errors import BatchDimError, BatchShapeError, UnsupportedBatchOp

Handler = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]

OPS: dict[Callable[..., Any], Handler] = {}

NAMESPACES = (torch, Tensor, F)


def implements(*funcs: Callable[..., Any]) -> Callable[[Handler], Handler]:
    """Register the decorated handler for each of ``funcs``."""
    def register(handler: Handler) -> Handler:
        for func in funcs:
            OPS[func] = handler
        return handler
    return register


def named(*names: str) -> list[Callable[..., Any]]:
    """``torch.<name>``, ``Tensor.<name>`` and ``torch.nn.functional.<name>``, where they exist:
    torch reaches the same op through all three spellings (``x + y`` arrives as
    ``Tensor.add``, ``y + x`` on a batch as ``Tensor.__radd__``)."""
    found = [getattr(space, name) for name in names for space in NAMESPACES
             if callable(getattr(space, name, None))]  # torch.bool is a dtype, not an op
    return list(dict.fromkeys(found))  # some spellings are the same object


def op_name(func: Callable[..., Any]) -> str:
    name = torch.overrides.resolve_name(func)
    return name or getattr(func, "__qualname__", repr(func))


def dispatch(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func`` with MaskedBatch arguments, or refuse with the op's name."""
    handler = OPS.get(func)
    if handler is None:
        raise UnsupportedBatchOp(
            f"{op_name(func)} is not implemented for MaskedBatch, and running it on the padded "
            "data could mix padding into the result. Compute it on batch.data with batch.mask "
            "yourself, or register a handler in matformer.modeling.batch_ops.")
    return handler(func, args, kwargs)


def unwrap(value: Any) -> Any:
    """``value`` with each MaskedBatch, also inside plain lists and tuples, replaced by its
    padded data."""
    if isinstance(value, MaskedBatch):
        return value.data
    if type(value) in (list, tuple):
        return type(value)(unwrap(item) for item in value)
    if isinstance(value, dict):
        return {key: unwrap(item) for key, item in value.items()}
    return value


def batches(values: Iterable[Any]) -> list[MaskedBatch]:
    return [value for value in values if isinstance(value, MaskedBatch)]


def axis(dim: int, batch: MaskedBatch, op: str) -> int:
    """``dim`` as a non-negative index into ``batch.data``; dimension 0 is refused."""
    rank = batch.data.dim()
    index = dim + rank if dim < 0 else dim
    if not 0 <= index < rank:
        raise BatchShapeError(f"{op}: dimension {dim} is out of range for a batch whose "
                              f"examples have {rank - 1} dimensions (plus the batch dimension).")
    if index == 0:
        raise BatchDimError(
            f"{op} over dimension 0 would mix examples: dimension 0 of a MaskedBatch is the "
            "batch dimension. Act on the example's own dimensions (1 and up), and combine "
            "examples only after unbatching.")
    return index


def full_mask(batch: MaskedBatch) -> Tensor:
    """The mask broadcast to the shape of ``batch.data``."""
    return batch.mask.expand_as(batch.data)


def real_data(batch: MaskedBatch) -> Tensor:
    """The data with its padding set to 0. Ops whose backward sums over rows (a weight's
    gradient) read this, so padding, even NaN from ``log`` of a padded 0, reaches no gradient:
    the fill passes no gradient back to the padding either."""
    return batch.data.masked_fill(~full_mask(batch), 0)
