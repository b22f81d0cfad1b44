"""Aggregation of one parameter's results from several clients: the first step of a round's
close (docs/architecture.md, "One round").

Element by element, over the clients whose region covers that element:
``agg = Σ tokens_i · value_i / Σ tokens_i``. Elements nobody covered stay 0 with ``covered``
False, and get no update. Each client's share ``tokens_i / Σ tokens`` is computed first, so a
single client's values come through unchanged (share exactly 1.0): no-compression federated
training then matches standalone training bit for bit.

Chunked encodings (``topk``, ``dct``) are summed where they were sent, in the coefficient
domain, and decoded once: the inverse transform is linear and every result's chunks lie on
the one grid of the universal shape, so inside a chunk that every result touching it covers
whole (the coverage, hence each share, is the same at every position) the weighted sum of
coefficients decodes to the weighted mean of the decoded values. Cost per result: its k
values per chunk. A chunk that some result covers only in part (a tier width off the chunk
grid) has shares that vary inside it; there each such result is decoded and weighted element
by element, as dense results always are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from modeling.compression.encodings import ChunkTopK, decode, get_encoding
from modeling.compression.grid import ChunkGrid, Region, full_region, region_slices
from modeling.compression.sparse import SparseResult
from modeling.compression.validation import validate_group
from modeling.errors import CompressionError


@dataclass(frozen=True, slots=True)
class Aggregate:
    values: Tensor  # float32 (float64 from float64 results), universal shape; 0 uncovered
    tokens: Tensor  # float32, universal shape: Σ tokens of the results covering each element

    @property
    def covered(self) -> Tensor:
        """bool, universal shape: True where some result covered the element."""
        return self.tokens > 0


def aggregate(results: Sequence[SparseResult], *, votes: bool = False) -> Aggregate:
    """Token-weighted, coverage-normalised mean of results for one parameter. Every result
    is validated before any arithmetic, so a bad one raises CompressionError and changes
    nothing. ``votes``: each result is one vote of its values' signs instead, the mean of the
    votes covering an element (signSGD with majority vote: under the sign rule, the majority
    decides, and no result weighs more than another whatever its tokens or magnitude)."""
    if not results:
        raise CompressionError("aggregate needs at least one result; skip parameters with none.")
    validate_group(results)
    shape = results[0].shape
    tokens = torch.zeros(shape, device=results[0].values.device)  # Σ tokens covering each
    by_region: dict[Region, int] = {}  # clients of one tier share a region: one pass each
    for result in results:
        by_region[result.region] = by_region.get(result.region, 0) + result.tokens
    for region, count in by_region.items():
        tokens[region_slices(region)] += count
    layout = {(r.encoding, r.chunk) for r in results}
    encoding = get_encoding(results[0].encoding)
    if votes or len(layout) > 1 or not isinstance(encoding, ChunkTopK):
        return Aggregate(values=_decoded_mean(results, tokens, votes=votes), tokens=tokens)
    return Aggregate(values=_coefficient_mean(results, tokens, encoding.inverse), tokens=tokens)


def _decoded_mean(results: Sequence[SparseResult], tokens: Tensor, *, votes: bool,
                  only: Tensor | None = None) -> Tensor:
    """Each result decoded and weighted element by element (its share, or one vote of its
    signs); ``only`` (bool, universal shape): where to add, elsewhere zero."""
    voters = torch.zeros_like(tokens)
    if votes:
        for result in results:
            voters[region_slices(result.region)] += 1
    wide = any(result.values.dtype == torch.float64 for result in results)
    values = torch.zeros_like(tokens, dtype=torch.float64 if wide else torch.float32)
    for result in results:
        where = region_slices(result.region)
        if votes:
            contribution = torch.sign(decode(result)) / voters[where]
        else:
            covering = tokens[where]
            share = torch.full_like(covering, result.tokens) / covering  # t/t is exactly 1.0
            contribution = decode(result) * share
        if only is not None:
            contribution = contribution * only[where]
        values[where] += contribution
    return values


def _coefficient_mean(results: Sequence[SparseResult], tokens: Tensor,
                      inverse: Callable[[Tensor], Tensor]) -> Tensor:
    """The weighted mean summed over the results' sent coefficients and decoded once."""
    grid = ChunkGrid(shape=results[0].shape, chunk=results[0].chunk)
    whole = full_region(grid.shape)
    inside = grid.blocks(torch.ones_like(tokens), whole).reshape(grid.size, -1) > 0
    per_chunk = grid.blocks(tokens, whole).reshape(grid.size, -1)  # (chunks, chunk_numel)
    high = per_chunk.masked_fill(~inside, -math.inf).amax(dim=1)
    low = per_chunk.masked_fill(~inside, math.inf).amin(dim=1)
    uniform = high == low  # one coverage over the chunk: every share is constant in it
    coefficients = torch.zeros((grid.size, grid.chunk_numel), device=tokens.device)
    for result in results:
        chunks = result.chunks.long()
        keep = uniform[chunks]
        weight = result.tokens / high[chunks[keep]]  # the share, per sent chunk
        rows = chunks[keep].unsqueeze(1) * grid.chunk_numel + result.indices[keep].long()
        coefficients.view(-1).index_add_(
            0, rows.reshape(-1), (result.values[keep].float() * weight.unsqueeze(1)).reshape(-1))
    values = grid.assemble(inverse(coefficients.reshape(grid.size, *grid.chunk)), whole)
    if not uniform.all():
        mixed = ~uniform.unsqueeze(1).expand(-1, grid.chunk_numel)
        only = grid.assemble(mixed.reshape(grid.size, *grid.chunk), whole)
        touching = [r for r in results if not uniform[r.chunks.long()].all()]
        values += _decoded_mean(touching, tokens, votes=False, only=only)
    return values


def scatter(result: SparseResult) -> Aggregate:
    """One result placed in its universal shape, with its coverage (validated)."""
    return aggregate([result])
