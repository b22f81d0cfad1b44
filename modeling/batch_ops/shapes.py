"""Shape ops: moving, adding, removing and joining an example's dimensions.

Data and mask move together, and ``dims`` follows its dimension. Dimension 0 stays the batch
dimension: ops that would move or remove it refuse. Concatenating along a dynamic dimension
refuses too, since the first part's padding would end up in the middle of the example. Stacking
makes the new dimension dynamic only when the stacked masks differ (as the per-step outputs of
a loop over a dynamic dimension do).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import reduce
from operator import and_
from typing import Any

import torch
from torch import Tensor

from matformer.modeling.batch import MaskedBatch
from matformer.modeling.batch_ops.table import axis, batches, implements, named, op_name
from matformer.modeling.errors import (
    BatchDimError,
    BatchShapeError,
    DynamicDimError,
    UnsupportedBatchOp,
)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str,
         default: Any = None) -> Any:
    return args[index] if len(args) > index else kwargs.get(name, default)


@implements(*named("unbind"))
def unbind(func: Callable[..., Any], args: tuple[Any, ...],
           kwargs: dict[str, Any]) -> tuple[MaskedBatch, ...]:
    x = args[0]
    d = axis(_arg(args, kwargs, 1, "dim", 0), x, op_name(func))
    dims = x.dims[:d - 1] + x.dims[d:]
    masks = (x.mask.unbind(d) if x.mask.shape[d] > 1
             else (x.mask.select(d, 0),) * x.data.shape[d])
    return tuple(MaskedBatch(data, mask, dims)
                 for data, mask in zip(x.data.unbind(d), masks, strict=True))


@implements(*named("transpose", "swapaxes", "swapdims"))
def transpose(func: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> MaskedBatch:
    x = args[0]
    a, b = (axis(_arg(args, kwargs, i, name), x, op_name(func))
            for i, name in ((1, "dim0"), (2, "dim1")))
    dims = list(x.dims)
    dims[a - 1], dims[b - 1] = dims[b - 1], dims[a - 1]
    return MaskedBatch(x.data.transpose(a, b), x.mask.transpose(a, b), tuple(dims))


@implements(*named("permute"))
def permute(func: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> MaskedBatch:
    x, rank = args[0], args[0].data.dim()
    order = args[1:] if len(args) > 2 else _arg(args, kwargs, 1, "dims")  # x.permute(0, 2, 1)
    if isinstance(order, int):
        order = (order,)
    order = tuple(d + rank if d < 0 else d for d in order)
    if order[0] != 0:
        raise BatchDimError(f"{op_name(func)}{order} moves the batch dimension; keep 0 first.")
    return MaskedBatch(x.data.permute(order), x.mask.permute(order),
                       tuple(x.dims[d - 1] for d in order[1:]))


@implements(*named("unsqueeze"))
def unsqueeze(func: Callable[..., Any], args: tuple[Any, ...],
              kwargs: dict[str, Any]) -> MaskedBatch:
    x = args[0]
    dim = _arg(args, kwargs, 1, "dim")
    d = dim + x.data.dim() + 1 if dim < 0 else dim
    if d == 0:
        raise BatchDimError("unsqueeze(0) would put a new dimension in front of the batch "
                            "dimension; unsqueeze at 1 or later.")
    return MaskedBatch(x.data.unsqueeze(d), x.mask.unsqueeze(d),
                       (*x.dims[:d - 1], False, *x.dims[d - 1:]))


@implements(*named("squeeze"))
def squeeze(func: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> MaskedBatch:
    x = args[0]
    dim = _arg(args, kwargs, 1, "dim")
    if dim is None:
        raise BatchDimError("squeeze() without dim could drop the batch dimension of a batch "
                            "of one; pass the dimension to squeeze.")
    d = axis(dim, x, op_name(func))
    if x.data.shape[d] != 1:
        return x  # as torch does: squeezing a dimension larger than one changes nothing
    return MaskedBatch(x.data.squeeze(d), x.mask.squeeze(d), x.dims[:d - 1] + x.dims[d:])


def _parts(items: list[Any], name: str) -> tuple[list[Tensor], list[Tensor], tuple[bool, ...]]:
    """Data and masks of ``items`` (plain tensors count as real everywhere) and the dynamic
    flags they share."""
    reference = batches(items)[0]
    rank = reference.data.dim()
    datas, masks = [], []
    for item in items:
        data = item.data if isinstance(item, MaskedBatch) else item
        if data.dim() != rank:
            raise BatchShapeError(f"{name}: every part needs {rank} dimensions (with the "
                                  f"batch dimension); one has shape {tuple(data.shape)}.")
        datas.append(data)
        masks.append(item.mask if isinstance(item, MaskedBatch)
                     else torch.ones((1,) * rank, dtype=torch.bool, device=data.device))
    dims = tuple(any(flags) for flags in zip(*(b.dims for b in batches(items)), strict=True))
    return datas, list(torch.broadcast_tensors(*masks)), dims


@implements(*named("stack"))
def stack(func: Callable[..., Any], args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> MaskedBatch:
    items = list(args[0])
    datas, masks, dims = _parts(items, op_name(func))
    dim = _arg(args, kwargs, 1, "dim", 0)
    d = dim + datas[0].dim() + 1 if dim < 0 else dim
    if d == 0:
        raise BatchDimError("stacking along dimension 0 would put a new dimension in front of "
                            "the batch dimension; stack along 1 or later.")
    dynamic = not all(torch.equal(mask, masks[0]) for mask in masks)
    mask = torch.stack(masks, d) if dynamic else masks[0].unsqueeze(d)
    return MaskedBatch(torch.stack(datas, d), mask, (*dims[:d - 1], dynamic, *dims[d - 1:]))


@implements(*named("cat", "concat", "concatenate"))
def cat(func: Callable[..., Any], args: tuple[Any, ...],
        kwargs: dict[str, Any]) -> MaskedBatch:
    items = list(args[0])
    datas, masks, dims = _parts(items, op_name(func))
    d = axis(_arg(args, kwargs, 1, "dim", 0), batches(items)[0], op_name(func))
    if dims[d - 1]:
        raise DynamicDimError(
            f"{op_name(func)} along dynamic dimension {d} would leave the first part's "
            "padding in the middle of each example; concatenate along a static dimension.")
    return MaskedBatch(torch.cat(datas, d), reduce(and_, masks), dims)


@implements(*named("new_zeros", "new_ones", "new_full", "new_empty", "new_tensor"))
def new_tensor(func: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Tensor:
    """A plain tensor with the batch's dtype and device: the sizes are given, so they are the
    same for every example."""
    if batches((*args[1:], *kwargs.values())):
        raise UnsupportedBatchOp(f"{op_name(func)} with sizes that differ per example is not "
                                 "supported; build the tensor at the largest size and mask it.")
    return func(args[0].data, *args[1:], **kwargs)
