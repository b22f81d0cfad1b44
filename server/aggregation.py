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
by element, as dense results always are. When every region lies on the chunk grid, no chunk
is covered in part and ``coefficient_mean`` stops before the decode: the compressed
broadcast takes the summed coefficients as they are (``Broadcast.encode_coefficients``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from matformer.modeling.compression.dct import chunkwise_dct
from matformer.modeling.compression.encodings import ChunkTopK, decode, get_encoding
from matformer.modeling.compression.grid import ChunkGrid, Region, full_region, region_slices
from matformer.modeling.compression.sparse import SparseResult
from matformer.modeling.compression.steps import bounding_box
from matformer.modeling.compression.validation import validate_group
from matformer.modeling.errors import CompressionError


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
    tokens = covering_tokens(results)
    layout = {(r.encoding, r.chunk) for r in results}
    encoding = get_encoding(results[0].encoding)
    if votes or len(layout) > 1 or not isinstance(encoding, ChunkTopK):
        return Aggregate(values=_decoded_mean(results, tokens, votes=votes), tokens=tokens)
    return Aggregate(values=_coefficient_mean(results, tokens, encoding), tokens=tokens)


def covering_tokens(results: Sequence[SparseResult]) -> Tensor:
    """float32, universal shape: Σ tokens of the results covering each element."""
    tokens = torch.zeros(results[0].shape, device=results[0].values.device)
    by_region: dict[Region, int] = {}  # clients of one tier share a region: one pass each
    for result in results:
        by_region[result.region] = by_region.get(result.region, 0) + result.tokens
    for region, count in by_region.items():
        tokens[region_slices(region)] += count
    return tokens


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


def coefficient_mean(results: Sequence[SparseResult]) -> Tensor:
    """The token-weighted mean of chunked results whose regions all lie on their chunk grid
    (``Broadcast.on_grid``: each chunk covered whole or not at all), as the chunkwise DCT
    of its values over the bounding box of their regions (shape ``grid.padded(box)``):
    what the broadcast compresses, with no inverse transform. Validated first, like
    ``aggregate``."""
    if not results:
        raise CompressionError(
            "coefficient_mean needs at least one result; skip parameters with none.")
    validate_group(results)
    encoding = get_encoding(results[0].encoding)
    if {(r.encoding, r.chunk) for r in results} != {(results[0].encoding, results[0].chunk)} \
            or not isinstance(encoding, ChunkTopK):
        raise CompressionError("coefficient_mean needs results of one chunked encoding and chunk.")
    grid = ChunkGrid(shape=results[0].shape, chunk=results[0].chunk)
    tokens, mixed = _coverage(results, grid)
    if bool(mixed.any()):
        raise CompressionError(
            "coefficient_mean needs regions on the chunk grid; aggregate these results.")
    box = bounding_box([r.region for r in results])
    coefficients = _weighted_sum(results, grid, box, tokens, mixed)
    if encoding.forward is chunkwise_dct:  # summed where they were sent, in the DCT already
        return coefficients
    return chunkwise_dct(encoding.inverse(coefficients, grid.chunk), grid.chunk)


def _coefficient_mean(results: Sequence[SparseResult], tokens: Tensor,
                      encoding: ChunkTopK) -> Tensor:
    """The weighted mean summed over the results' sent coefficients and decoded once."""
    grid = ChunkGrid(shape=results[0].shape, chunk=results[0].chunk)
    whole = full_region(grid.shape)
    chunk_tokens, mixed = _coverage(results, grid)
    summed = _weighted_sum(results, grid, whole, chunk_tokens, mixed)
    crop = region_slices(whole)
    values = encoding.inverse(summed, grid.chunk)[crop]
    if bool(mixed.any()):
        spread = [n for count in grid.counts for n in (count, 1)]
        pairs = [n for pair in zip(grid.counts, grid.chunk, strict=True) for n in pair]
        only = mixed.view(spread).expand(pairs).reshape(grid.padded(whole))[crop]
        touching = [r for r in results if bool(mixed[r.chunks.long()].any())]
        values += _decoded_mean(touching, tokens, votes=False, only=only)
    return values


def _coverage(results: Sequence[SparseResult], grid: ChunkGrid) -> tuple[Tensor, Tensor]:
    """Per chunk of the grid: the tokens of the results covering it whole (float32), and
    whether some result covers only part of it (bool). Regions start on the grid, so a
    result that covers part of a chunk makes its shares vary inside it."""
    tokens = torch.zeros(grid.size)
    mixed = torch.zeros(grid.size, dtype=torch.bool)
    by_region: dict[Region, int] = {}  # clients of one tier share a region: one pass each
    for result in results:
        by_region[result.region] = by_region.get(result.region, 0) + result.tokens
    for region, count in by_region.items():
        ids = grid.chunk_ids(region)
        partial = torch.zeros((), dtype=torch.bool)
        for (_, stop), size, c, n in zip(region, grid.shape, grid.chunk,
                                         grid.region_counts(region), strict=True):
            last = torch.zeros(n, dtype=torch.bool)  # along this dimension: the region
            last[-1] = stop % c != 0 and stop != size  # ends inside its last chunk
            partial = partial.unsqueeze(-1) | last
        partial = partial.reshape(-1)
        tokens[ids[~partial]] += count
        mixed[ids[partial]] = True
    device = results[0].chunks.device  # looked up by the results' chunk ids
    return tokens.to(device), mixed.to(device)


def _weighted_sum(results: Sequence[SparseResult], grid: ChunkGrid, region: Region,
                  tokens: Tensor, mixed: Tensor) -> Tensor:
    """Σ share · sent coefficients over the chunks no result covers in part, laid out
    chunkwise over the chunks ``region`` touches (each result's chunks lie inside it).
    Added in the results' order, a batch of results at a time (``SUM_BATCH`` values, one k
    per batch: a hundred small results are one ``index_add_``, a large one is its own),
    which adds every element in the same order as one result at a time, so the same bits:
    ``index_add_`` on a flat tensor adds in the index's order. Where a chunk lies is looked up, not
    computed, for each result."""
    device = results[0].values.device
    summed = torch.zeros(grid.padded(region), device=device)
    ids = grid.chunk_ids(region).to(device)
    starts = torch.zeros(grid.size, dtype=torch.int64, device=device)
    starts[ids] = grid.chunk_starts(region, ids)
    offsets = grid.offsets(region, device)
    tokens, partly = tokens.to(device), bool(mixed.any())
    batch: list[SparseResult] = []
    held = 0
    for result in results:
        if batch and result.indices.shape[1] != batch[0].indices.shape[1]:  # k changes
            _add_batch(summed.view(-1), batch, starts, offsets, tokens, mixed if partly else None)
            batch, held = [], 0
        batch.append(result)
        held += result.values.numel()
        if held >= SUM_BATCH:
            _add_batch(summed.view(-1), batch, starts, offsets, tokens, mixed if partly else None)
            batch, held = [], 0
    if batch:
        _add_batch(summed.view(-1), batch, starts, offsets, tokens, mixed if partly else None)
    return summed


SUM_BATCH = 2**18  # values added by one index_add_ in _weighted_sum (above: one result each)


def _add_batch(flat: Tensor, batch: Sequence[SparseResult], starts: Tensor, offsets: Tensor,
               tokens: Tensor, mixed: Tensor | None) -> None:
    """``flat`` += each result's values times its share (its tokens over the chunk's), as
    float32, at the positions ``starts`` and ``offsets`` give; chunks ``mixed`` covers in
    part are left out."""
    one = len(batch) == 1
    chunks = (batch[0].chunks if one else torch.cat([r.chunks for r in batch])).long()
    indices = (batch[0].indices if one else torch.cat([r.indices for r in batch])).long()
    values = batch[0].values if one else torch.cat([r.values for r in batch])
    sent = torch.tensor([float(r.tokens) for r in batch], device=flat.device)
    sent = sent.repeat_interleave(torch.tensor([len(r.chunks) for r in batch],
                                               device=flat.device))
    if mixed is not None:
        keep = ~mixed[chunks]
        if not bool(keep.all()):
            chunks, indices, values, sent = chunks[keep], indices[keep], values[keep], sent[keep]
    share = tokens[chunks].reciprocal() * sent  # float32, as result.tokens / tokens[chunks]
    index = starts[chunks].unsqueeze(1) + offsets[indices]
    flat.index_add_(0, index.view(-1), torch.mul(values, share.unsqueeze(1)).view(-1))


def scatter(result: SparseResult) -> Aggregate:
    """One result placed in its universal shape, with its coverage (validated)."""
    return aggregate([result])
