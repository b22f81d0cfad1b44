"""Example-level helpers that take a plain tensor (one example at batch size one) or a
MaskedBatch and mean the same thing for both, so one function body serves a single example and
a whole batch: ``batch_ones`` / ``batch_zeros``, ``split_dim`` / ``join_dims`` and
``causal_mask``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from matformer.modeling.batch import MaskedBatch
from matformer.modeling.errors import BatchDimError, BatchShapeError, DynamicDimError

Value = Tensor | MaskedBatch


def batch_ones(x: Value, *sizes: int) -> Value:
    """Ones with one row per example of ``x``: a plain (B, *sizes) tensor (B is 1 for a plain
    tensor). With no sizes, ones shaped like each example of ``x`` (a batch keeps its mask)."""
    return _filled(x, sizes, 1)


def batch_zeros(x: Value, *sizes: int) -> Value:
    """As ``batch_ones``, with zeros."""
    return _filled(x, sizes, 0)


def _filled(x: Value, sizes: tuple[int, ...], value: float) -> Value:
    data = x.data if isinstance(x, MaskedBatch) else x
    if sizes:
        return data.new_full((data.shape[0], *sizes), value)
    if isinstance(x, MaskedBatch):
        return MaskedBatch(torch.full_like(data, value), x.mask, x.dims)
    return torch.full_like(data, value)


def split_dim(x: Value, dim: int, split_by: int) -> Value:
    """Split dimension ``dim`` of size n into two, (n // split_by, split_by): e.g. features
    into (features per head, heads). A dynamic dimension cannot be split (each example's size
    differs); the batch dimension can, when ``join_dims`` folded a static dimension into it."""
    data = x.data if isinstance(x, MaskedBatch) else x
    d = dim + data.dim() if dim < 0 else dim
    if data.shape[d] % split_by:
        raise BatchShapeError(f"split_dim: dimension {dim} has size {data.shape[d]}, which "
                              f"{split_by} does not divide.")
    shape = (*data.shape[:d], data.shape[d] // split_by, split_by, *data.shape[d + 1:])
    if not isinstance(x, MaskedBatch):
        return data.reshape(shape)
    if d == 0:
        # rows that join_dims made from one example share its mask: keep the first
        mask = x.mask.reshape(shape[0], split_by, *x.mask.shape[1:])[:, :1]
        return MaskedBatch(data.reshape(shape), mask, (False, *x.dims))
    if x.dims[d - 1]:
        raise DynamicDimError(f"split_dim: dimension {d} is dynamic, so each example would "
                              "split differently; split a static dimension.")
    return MaskedBatch(data.reshape(shape), x.mask.unsqueeze(d),
                       (*x.dims[:d - 1], False, *x.dims[d - 1:]))


def join_dims(x: Value, dim1: int, dim2: int) -> Value:
    """Move ``dim2`` next to ``dim1`` and merge the two into one dimension of their product.
    Joining a dimension into the batch dimension (``dim1 == 0``) makes each example several
    rows (e.g. one per attention head); two example dimensions can be joined only when both
    are static, since padding would otherwise land between real data."""
    data = x.data if isinstance(x, MaskedBatch) else x
    rank = data.dim()
    d1, d2 = (d + rank if d < 0 else d for d in (dim1, dim2))
    order = [d for d in range(rank) if d != d2]
    order.insert(order.index(d1) + 1, d2)
    moved = data.permute(order)
    at = order.index(d1)  # dims ``at`` and ``at + 1`` merge
    shape = (*moved.shape[:at], moved.shape[at] * moved.shape[at + 1], *moved.shape[at + 2:])
    if not isinstance(x, MaskedBatch):
        return moved.reshape(shape)
    if d2 == 0:
        raise BatchDimError("join_dims cannot move the batch dimension (dim2 == 0); pass it "
                            "as dim1 to fold another dimension into it.")
    dims = tuple(flag for d, flag in enumerate(x.dims, start=1) if d != d2)
    mask = x.mask.permute(order)
    if d1 == 0:
        mask = mask.expand(-1, moved.shape[1], *mask.shape[2:])
        return MaskedBatch(moved.reshape(shape), mask.reshape(-1, *mask.shape[2:]), dims)
    if x.dims[d1 - 1] or x.dims[d2 - 1]:
        raise DynamicDimError(f"join_dims: dimensions {d1} and {d2} must both be static; "
                              "joining a dynamic one would leave padding between real data.")
    return MaskedBatch(moved.reshape(shape), mask.reshape(*mask.shape[:at], 1,
                                                           *mask.shape[at + 2:]), dims)


def causal_mask(x: Value, in_dim: int, out_dim: int) -> Value:
    """Hide position i of ``in_dim`` from position j of ``out_dim`` wherever i > j: attention
    scores (B, queries, keys) take ``causal_mask(scores, in_dim=2, out_dim=1)``. A batch marks
    those positions as padding (both dimensions become dynamic); a plain tensor gets the
    dtype's most negative value there, which a softmax turns into exactly 0."""
    data = x.data if isinstance(x, MaskedBatch) else x
    rank = data.dim()
    d_in, d_out = (d + rank if d < 0 else d for d in (in_dim, out_dim))
    if d_in == d_out or (0 in (d_in, d_out) and isinstance(x, MaskedBatch)):
        raise BatchDimError("causal_mask needs two different example dimensions (1 and up).")
    i = torch.arange(data.shape[d_in], device=data.device)
    j = torch.arange(data.shape[d_out], device=data.device)
    shape_in, shape_out = [1] * rank, [1] * rank
    shape_in[d_in], shape_out[d_out] = -1, -1
    visible = i.reshape(shape_in) <= j.reshape(shape_out)
    if not isinstance(x, MaskedBatch):
        return data.masked_fill(~visible, torch.finfo(data.dtype).min)
    dims = tuple(flag or d in (d_in, d_out) for d, flag in enumerate(x.dims, start=1))
    return MaskedBatch(data, x.mask & visible, dims)
