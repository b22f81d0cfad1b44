"""Reductions over an example's own dimensions (sum, mean, max, ...).

Over a static dimension the op runs on the data as it is. Over a dynamic one the padding is
first overwritten with the op's neutral value (0 for a sum, -inf for a max, ...), so it cannot
change the result; a mean divides by each example's own count. Ops without a neutral value
(std, var, median) refuse a dynamic dimension instead of counting padding. Every reduction
refuses dimension 0, which would mix examples. With no ``dim``, the reduction covers each
example's own dimensions and gives one value per example (``dims == ()``).

The result's mask is the input's, reduced with "any": a reduced position is real if any of the
positions it summarises was.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from matformer.modeling.batch import MaskedBatch
from matformer.modeling.batch_ops.elementwise import elementwise
from matformer.modeling.batch_ops.table import axis, full_mask, implements, named, op_name
from matformer.modeling.errors import DynamicDimError

Fill = Callable[[torch.dtype], float | int | bool]


def lowest(dtype: torch.dtype) -> float | int | bool:
    if dtype == torch.bool:
        return False
    return -float("inf") if dtype.is_floating_point else torch.iinfo(dtype).min


def highest(dtype: torch.dtype) -> float | int | bool:
    if dtype == torch.bool:
        return True
    return float("inf") if dtype.is_floating_point else torch.iinfo(dtype).max


@dataclass(frozen=True, slots=True)
class Reduction:
    fill: Fill | None  # what padding becomes so it cannot change the result; None: refuse
    keepdim_at: int = 2  # position of ``keepdim`` among the positional arguments


REDUCTIONS = {
    "sum": Reduction(lambda dtype: 0),
    "mean": Reduction(lambda dtype: 0),  # divided by the real count below
    "prod": Reduction(lambda dtype: 1),
    "amax": Reduction(lowest),
    "amin": Reduction(highest),
    "max": Reduction(lowest),
    "min": Reduction(highest),
    "argmax": Reduction(lowest),
    "argmin": Reduction(highest),
    "logsumexp": Reduction(lowest),
    "any": Reduction(lambda dtype: False),
    "all": Reduction(lambda dtype: True),
    "std": Reduction(None, keepdim_at=3),
    "var": Reduction(None, keepdim_at=3),
    "median": Reduction(None),
}
BY_OP = {func: REDUCTIONS[name] for name in REDUCTIONS for func in named(name)}


@implements(*BY_OP)
def reduction(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, rest = args[0], args[1:]
    if func.__name__ in ("max", "min") and (
            "other" in kwargs or (rest and isinstance(rest[0], Tensor | MaskedBatch))):
        return elementwise(func, args, kwargs)  # max(a, b): the elementwise overload
    spec = BY_OP[func]
    name = op_name(func)
    dim = rest[0] if rest else kwargs.get("dim")
    keepdim = (rest[spec.keepdim_at - 1] if len(rest) >= spec.keepdim_at
               else kwargs.get("keepdim", False))
    if dim is None or dim == ():
        options = {key: value for key, value in kwargs.items() if key not in ("dim", "keepdim")}
        return _per_example(func, x, name, spec, options)
    axes = tuple(axis(d, x, name) for d in (dim if isinstance(dim, tuple | list) else (dim,)))
    data = _fill_padding(x, axes, name, spec)
    if func.__name__ == "mean" and any(x.dims[d - 1] for d in axes):
        count = full_mask(x).sum(dim=axes, keepdim=keepdim).clamp(min=1)
        result: Any = data.sum(dim=axes, keepdim=keepdim) / count
    else:
        result = func(data, *rest, **kwargs)
    mask = x.mask.any(dim=axes, keepdim=keepdim)
    if keepdim:  # a kept, reduced dimension has size 1: static
        dims = tuple(flag and d + 1 not in axes for d, flag in enumerate(x.dims))
    else:
        dims = tuple(flag for d, flag in enumerate(x.dims) if d + 1 not in axes)
    if isinstance(result, Tensor):
        return MaskedBatch(result, mask, dims)
    return type(result)([MaskedBatch(part, mask, dims) for part in result])  # (values, indices)


def _fill_padding(x: MaskedBatch, axes: tuple[int, ...], name: str, spec: Reduction) -> Tensor:
    dynamic = [d for d in axes if x.dims[d - 1]]
    if not dynamic:
        return x.data
    if spec.fill is None:
        raise DynamicDimError(
            f"{name} over dynamic dimension {dynamic[0]} would count each example's padding. "
            "Reduce over a static dimension, or compute it from masked sums (x.sum(dim) and "
            "the lengths).")
    return x.data.masked_fill(~full_mask(x), spec.fill(x.data.dtype))


def _per_example(func: Callable[..., Any], x: MaskedBatch, name: str, spec: Reduction,
                 options: dict[str, Any]) -> MaskedBatch:
    """The reduction over all of each example's dimensions: one value per example."""
    if func.__name__ in ("argmax", "argmin") and any(x.dims):
        raise DynamicDimError(f"{name} without dim gives flat indices, which padding shifts; "
                              "pass dim.")
    axes = tuple(range(1, x.data.dim()))
    data = _fill_padding(x, axes, name, spec).reshape(x.data.shape[0], -1)  # (B, positions)
    if func.__name__ == "mean":
        count = full_mask(x).reshape(data.shape).sum(dim=1).clamp(min=1)
        values = data.sum(dim=1) / count
    else:
        values = func(data, 1, **options)
        if not isinstance(values, Tensor):
            values = values[0]  # max(x) gives values only, as it does without a dim
    return MaskedBatch(values, x.mask.reshape(x.mask.shape[0], -1).any(dim=1), ())
