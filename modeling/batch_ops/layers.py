"""Neural-network ops whose masking is more than elementwise: softmax, matrix products,
linear and norm layers, embeddings and recurrent cells.

What each does at the mask:

- softmax / log_softmax over a dynamic dimension: padding is set to -inf first, so it gets
  zero probability and real positions share all of it; the padding of the result is then set
  to 0 (an all-padding slice would otherwise hold NaN). The mask is unchanged.
- matmul / ``@``: padding of both operands is zeroed, so a contraction over a dynamic
  dimension sums real terms only; an output position is real if any real term reaches it.
- linear: contracts the last dimension, which must be static; the mask is unchanged.
- layer_norm / rms_norm: normalise the last dimensions, which must be static.
- matmul, linear, the norms and the cells read the input with its padding set to 0, so
  padding reaches no weight's gradient (``table.real_data``).
- embedding: padded ids (which may be out of range, e.g. -1) are looked up as the padding
  index or 0; the new feature dimension is static.
- RNN / GRU / LSTM cells: an example whose input is padding at this step keeps its state
  unchanged, as if the step did not happen, so a plain loop over ``x.unbind(1)`` ends with each
  example's state after its own last step. The result is valid wherever the incoming state was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from matformer.modeling.batch import MaskedBatch
from matformer.modeling.batch_ops.table import (
    axis,
    full_mask,
    implements,
    named,
    op_name,
    real_data,
)
from matformer.modeling.errors import (
    BatchShapeError,
    DynamicDimError,
    UnsupportedBatchOp,
)


def _only_first_batched(func: Callable[..., Any], args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> MaskedBatch:
    x = args[0]
    if not isinstance(x, MaskedBatch) or any(
            isinstance(value, MaskedBatch) for value in (*args[1:], *kwargs.values())):
        raise UnsupportedBatchOp(f"{op_name(func)} takes a MaskedBatch only as its input; "
                                 "weights that differ per example are not supported.")
    return x


@implements(*named("softmax", "log_softmax"))
def softmax(func: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> MaskedBatch:
    x = _only_first_batched(func, args, kwargs)
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None:
        raise UnsupportedBatchOp(f"{op_name(func)} on a MaskedBatch needs an explicit dim.")
    if not x.dims[axis(dim, x, op_name(func)) - 1]:
        return MaskedBatch(func(x.data, *args[1:], **kwargs), x.mask, x.dims)
    real = full_mask(x)
    out = func(x.data.masked_fill(~real, -float("inf")), *args[1:], **kwargs)
    return MaskedBatch(out.masked_fill(~real, 0), x.mask, x.dims)


@implements(F.linear)
def linear(func: Callable[..., Any], args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> MaskedBatch:
    x = _only_first_batched(func, args, kwargs)
    _require_static_tail(x, 1, "F.linear")
    return MaskedBatch(func(real_data(x), *args[1:], **kwargs), x.mask, x.dims)


@implements(*named("layer_norm", "rms_norm"))
def norm(func: Callable[..., Any], args: tuple[Any, ...],
         kwargs: dict[str, Any]) -> MaskedBatch:
    x = _only_first_batched(func, args, kwargs)
    shape = args[1] if len(args) > 1 else kwargs["normalized_shape"]
    _require_static_tail(x, len(shape) if isinstance(shape, list | tuple) else 1,
                         op_name(func))
    return MaskedBatch(func(real_data(x), *args[1:], **kwargs), x.mask, x.dims)


def _require_static_tail(x: MaskedBatch, count: int, name: str) -> None:
    """The last ``count`` dimensions, which ``name`` mixes together, are all static."""
    if x.data.dim() <= count:
        raise BatchShapeError(f"{name} would mix the batch dimension into its last {count} "
                              "dimension(s); give each example a feature dimension.")
    if any(x.dims[-count:]):
        raise DynamicDimError(
            f"{name} mixes the last {count} dimension(s) of each example, and one is dynamic, "
            "so padding would enter the result. Move the dynamic dimension elsewhere "
            "(transpose) or pad to a fixed size and mark it static.")


@implements(F.embedding)
def embedding(func: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> MaskedBatch:
    ids = _only_first_batched(func, args, kwargs)
    weight = args[1] if len(args) > 1 else kwargs["weight"]
    padding = args[2] if len(args) > 2 else kwargs.get("padding_idx")
    filler = 0 if padding is None else padding % weight.shape[0]
    data = func(ids.data.masked_fill(~full_mask(ids), filler), *args[1:], **kwargs)
    return MaskedBatch(data, ids.mask.unsqueeze(-1), (*ids.dims, False))


@implements(*named("matmul", "__matmul__", "__rmatmul__"))
def matmul(func: Callable[..., Any], args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> MaskedBatch:
    left, right = (args[1], args[0]) if func is Tensor.__rmatmul__ else (args[0], args[1])
    batch = left if isinstance(left, MaskedBatch) else right
    _check_matmul_operands(left, right, batch.data.shape[0])
    data = torch.matmul(*(real_data(side) if isinstance(side, MaskedBatch) else side
                          for side in (left, right)))
    size = (left.data if isinstance(left, MaskedBatch) else left).shape[-1]
    reach = torch.matmul(_reach(left, size, last=True), _reach(right, size, last=False)) > 0
    return MaskedBatch(data, reach, tuple(length > 1 for length in reach.shape[1:]))


def _check_matmul_operands(left: Any, right: Any, size: int) -> None:
    """Refuse products in which torch would treat the batch dimension as a matrix row or
    contract it, or broadcast it against a plain tensor's own leading dimension."""
    both = isinstance(left, MaskedBatch) and isinstance(right, MaskedBatch)
    rank = (left if isinstance(left, MaskedBatch) else right).data.dim()
    for side, operand in (("left", left), ("right", right)):
        if isinstance(operand, MaskedBatch):
            own = operand.data.dim()
            if own < 2 or (own == 2 and (side == "right" or both)):
                raise BatchShapeError(
                    f"matmul: the {side} batch has examples with {own - 1} dimension(s), so "
                    "torch would treat its batch dimension as a matrix dimension. Give each "
                    "example a matrix shape (unsqueeze) first.")
        elif operand.dim() > rank or (operand.dim() > 2 and operand.shape[0] not in (1, size)):
            raise BatchShapeError(
                f"matmul: a plain {operand.dim()}-d tensor of shape {tuple(operand.shape)} "
                "would broadcast against the batch dimension; write it at batch size one.")
    if both and left.data.dim() != right.data.dim():
        raise BatchShapeError("matmul: both batches need the same number of dimensions.")


def _reach(operand: Tensor | MaskedBatch, size: int, *, last: bool) -> Tensor:
    """The operand's mask as 0/1 with its contracted dimension at full ``size``: multiplying
    two of these counts the real terms behind each output position."""
    if isinstance(operand, MaskedBatch):
        mask = operand.mask.float()  # at least (B, rows, columns): smaller ones are refused
        if last:
            return mask.expand(*mask.shape[:-1], size)
        return mask.expand(*mask.shape[:-2], size, mask.shape[-1])
    shape = [1] * operand.dim()
    shape[-1 if last or operand.dim() == 1 else -2] = size
    return torch.ones(shape, device=operand.device)


@implements(*named("rnn_tanh_cell", "rnn_relu_cell", "gru_cell", "lstm_cell"))
def recurrent_cell(func: Callable[..., Any], args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> MaskedBatch | tuple[MaskedBatch, ...]:
    x, state, *weights = args
    paired = isinstance(state, tuple | list)  # LSTM: (h, c)
    states = tuple(state) if paired else (state,)
    if any(isinstance(w, MaskedBatch) for w in (*weights, *kwargs.values())):
        raise UnsupportedBatchOp(f"{op_name(func)}: weights cannot differ per example.")
    size = next(value.data.shape[0] for value in (x, *states) if isinstance(value, MaskedBatch))
    step = None  # (B,) which examples have a real input at this step
    if isinstance(x, MaskedBatch):
        _require_static_tail(x, 1, op_name(func))
        step = x.mask.reshape(size, -1).any(dim=1)
    current = [_rows(s, size) for s in states]
    new = func(real_data(x) if isinstance(x, MaskedBatch) else x,
               tuple(current) if paired else current[0], *weights, **kwargs)
    results = []
    for before, after, original in zip(current, new if paired else (new,), states, strict=True):
        kept = after if step is None else torch.where(step[:, None], after, before)
        mask = (original.mask if isinstance(original, MaskedBatch)
                else torch.ones(size, 1, dtype=torch.bool, device=kept.device))
        results.append(MaskedBatch(kept, mask, (False,)))
    return tuple(results) if paired else results[0]


def _rows(state: Tensor | MaskedBatch, size: int) -> Tensor:
    """A state as (B, H) data; a plain state written at batch size one is shared."""
    data = real_data(state) if isinstance(state, MaskedBatch) else state
    if data.dim() != 2 or data.shape[0] not in (1, size):
        raise BatchShapeError(f"a recurrent state of shape {tuple(data.shape)} does not have "
                              f"one row per example (batch size {size}).")
    return data.expand(size, -1)
