"""Partial sums: several members' results for one parameter folded into one result per region,
which is what a relay sends upstream (docs/architecture.md, "Relays").

The coordinator weighs each result by its tokens over the tokens covering an element. For the
members of one region (one tier) with tokens ``t_i`` and sent values ``c_i``::

    partial = Σ (t_i / T) · c_i   with tokens T = Σ t_i

weighed at the root by ``T / T_all``, adds ``Σ (t_i / T_all) · c_i``: what the members'
own results would have added, up to float32 rounding (another order of the sums, one more
division). Results of chunked encodings are summed where they were sent, in the coefficient
domain; the partial keeps, per chunk, the positions some member sent (as many as the most
crowded chunk needs, at most the whole chunk), so it is never larger than its region's
dense coefficients however many members it folds. Values are float32.

    partials = partial_sums(results)   # one parameter's results, several regions
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from matformer.modeling.compression.grid import ChunkGrid, Region
from matformer.modeling.compression.sparse import SparseResult
from matformer.modeling.compression.validation import validate_group
from matformer.modeling.errors import CompressionError


def partial_sums(results: Sequence[SparseResult]) -> list[SparseResult]:
    """One result per region of ``results`` (one parameter's, of one encoding and chunk), in
    the order the regions first appear. Validated first: a bad result raises
    CompressionError."""
    if not results:
        raise CompressionError("partial_sums needs at least one result.")
    validate_group(results)
    if len({(r.encoding, r.chunk) for r in results}) > 1:
        raise CompressionError(f"{results[0].name}: results of several encodings or chunks "
                               "cannot be summed; every member sends the run's.")
    by_region: dict[Region, list[SparseResult]] = {}
    for result in results:
        by_region.setdefault(result.region, []).append(result)
    return [_fold(group) for group in by_region.values()]


def _shares(group: Sequence[SparseResult]) -> list[torch.Tensor]:
    """Each result's tokens over the group's, in float32 as the coordinator divides them (a
    lone result's share is exactly 1.0)."""
    total = torch.tensor(float(sum(r.tokens for r in group)))
    return [torch.tensor(float(r.tokens)) / total for r in group]


def _fold(group: Sequence[SparseResult]) -> SparseResult:
    first = group[0]
    tokens = sum(r.tokens for r in group)
    if not first.chunk:  # dense: the region's values, weighted
        wide = any(r.values.dtype == torch.float64 for r in group)
        summed = torch.zeros(first.values.shape, dtype=torch.float64 if wide else torch.float32)
        for result, share in zip(group, _shares(group), strict=True):
            summed += result.values.to(summed.dtype) * share
        return SparseResult(name=first.name, shape=first.shape, region=first.region,
                            encoding=first.encoding, chunk=(), chunks=first.chunks,
                            indices=first.indices, values=summed, tokens=tokens)
    grid = ChunkGrid(shape=first.shape, chunk=first.chunk)
    ids = torch.unique(torch.cat([r.chunks.long() for r in group]))  # sorted
    summed = torch.zeros(len(ids), grid.chunk_numel)  # (n, chunk_numel): the chunks sent
    for result, share in zip(group, _shares(group), strict=True):
        rows = torch.searchsorted(ids, result.chunks.long())
        flat = rows.unsqueeze(1) * grid.chunk_numel + result.indices.long()  # (n_i, k)
        summed.view(-1).index_add_(0, flat.reshape(-1),
                                   (result.values.float() * share).reshape(-1))
    sent = torch.zeros_like(summed, dtype=torch.bool)
    for result in group:  # a position some member sent, even where the sum is zero
        rows = torch.searchsorted(ids, result.chunks.long())
        sent[rows.unsqueeze(1), result.indices.long()] = True
    k = int(sent.sum(dim=1).max()) if len(ids) else 0
    # the k sent positions of each chunk first (ties broken by position), ascending
    order = (sent.float() * 2 - torch.arange(grid.chunk_numel) / grid.chunk_numel)
    positions = order.topk(k, dim=1).indices.sort(dim=1).values
    return SparseResult(name=first.name, shape=first.shape, region=first.region,
                        encoding=first.encoding, chunk=first.chunk, chunks=ids,
                        indices=positions, values=summed.gather(1, positions), tokens=tokens)


class Recompressor:
    """A relay's own error feedback (``matformer relay --topk K``): each partial cut to its
    ``topk`` largest coefficients per chunk, the rest carried, per parameter and region, into
    the next round's partial. It makes what a relay sends the size of one member's result
    however many members it folds, at the price of exactness: the root gets the members' sum
    late where it was cut, as a member's own error feedback sends late what its top-k left.
    Dense results pass unchanged.

    The carried coefficients are float32, one per element of the region's chunks: the size of
    the region's weights in float32, per tier region the relay's members hold."""

    def __init__(self, topk: int) -> None:
        if topk < 1:
            raise CompressionError(f"a relay keeps at least one coefficient per chunk, got "
                                   f"--topk {topk}.")
        self.topk = topk
        self.carried: dict[tuple[str, Region], torch.Tensor] = {}  # (n, chunk_numel) each

    def __call__(self, partial: SparseResult) -> SparseResult:
        if not partial.chunk:
            return partial
        grid = ChunkGrid(shape=partial.shape, chunk=partial.chunk)
        ids = grid.chunk_ids(partial.region)  # every chunk of the region, ascending
        key = (partial.name, partial.region)
        summed = self.carried.pop(key, None)
        if summed is None:
            summed = torch.zeros(len(ids), grid.chunk_numel)
        rows = torch.searchsorted(ids, partial.chunks.long()).unsqueeze(1)
        summed[rows, partial.indices.long()] += partial.values.float()  # positions unique
        k = min(self.topk, grid.chunk_numel)
        positions = summed.abs().topk(k, dim=1).indices.sort(dim=1).values
        values = summed.gather(1, positions)
        self.carried[key] = summed.scatter_(1, positions, 0.0)
        return SparseResult(name=partial.name, shape=partial.shape, region=partial.region,
                            encoding=partial.encoding, chunk=partial.chunk, chunks=ids,
                            indices=positions, values=values, tokens=partial.tokens)
