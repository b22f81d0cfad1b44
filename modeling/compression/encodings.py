"""Encodings of a region's values, by name (``ENCODERS``, the one list of them).

- ``dense``: the region's values as they are (no compression, exact).
- ``topk``: per chunk, the k values of largest magnitude and their positions.
- ``dct``: per chunk, the k DCT-II coefficients of largest magnitude (DeMo).

Decoding needs nothing but the result: the chunk shape, region and encoding travel in it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from matformer.modeling.compression.dct import chunkwise_dct, chunkwise_idct, stacked
from matformer.modeling.compression.grid import ChunkGrid, Region, region_shape
from matformer.modeling.compression.quantize import quantize
from matformer.modeling.compression.sparse import SparseResult
from matformer.modeling.errors import (
    ChunkIdError,
    ChunkIndexError,
    CompressionError,
    ResultShapeMismatch,
    UnknownEncoding,
    did_you_mean,
)

# chunks laid out chunkwise (every dimension whole chunks), chunk shape → the same layout
Transform = Callable[[Tensor, tuple[int, ...]], Tensor]


class Encoded(NamedTuple):
    chunk: tuple[int, ...]  # SparseResult fields of the same names
    chunks: Tensor
    indices: Tensor
    values: Tensor
    scales: Tensor | None = None  # with value_bits: each chunk's scale (modeling.quantize)


class Encoding(Protocol):
    def encode(
        self, values: Tensor, grid: ChunkGrid, region: Region, *, topk: int,
        value_dtype: torch.dtype, value_bits: int = 0,
    ) -> Encoded:
        """Encode region-shaped ``values``; ``topk`` values per chunk in ``value_dtype``, or
        (``value_bits``) as codes of that many bits and a scale per chunk."""
        ...

    def decode(self, result: SparseResult) -> Tensor:
        """The region-shaped float32 values a result stands for."""
        ...

    def check(self, result: SparseResult) -> None:
        """Raise a CompressionError unless region, chunk, ids, indices and the values' shape
        are consistent with this encoding (``validate`` checks the rest)."""
        ...

    def all_valid(self, results: Sequence[SparseResult]) -> bool:
        """Whether ``check`` passes for every result (False: some ``check`` raises)."""
        ...


class Dense:
    """Values as they are (a copy); decoding returns them as float32 (float64 ones as they
    are), without a copy when they are that already."""

    def encode(
        self, values: Tensor, grid: ChunkGrid, region: Region, *, topk: int,
        value_dtype: torch.dtype, value_bits: int = 0,
    ) -> Encoded:
        empty = torch.empty((0,), dtype=torch.int64)
        return Encoded((), empty, empty.reshape(0, 0), values.detach().clone())

    def decode(self, result: SparseResult) -> Tensor:
        values = result.values
        return values if values.dtype == torch.float64 else values.float()

    def check(self, result: SparseResult) -> None:
        ChunkGrid.of(result.shape, 1).check_region(result.region)
        if result.chunk or result.chunks.numel() or result.indices.numel():
            raise ResultShapeMismatch(
                f"{result.name}: a dense result has chunk () and empty chunks and indices."
            )
        _check_values_shape(result, region_shape(result.region))

    def all_valid(self, results: Sequence[SparseResult]) -> bool:
        return _each_valid(self.check, results)


@dataclass(frozen=True, slots=True)
class ChunkTopK:
    """Top-k magnitudes per chunk after an orthonormal transform (identity for plain top-k),
    applied to chunks where they lie (``dct.chunkwise``)."""

    forward: Transform
    inverse: Transform

    def encode(
        self, values: Tensor, grid: ChunkGrid, region: Region, *, topk: int,
        value_dtype: torch.dtype, value_bits: int = 0,
    ) -> Encoded:
        blocks = grid.blocks(values.detach().float(), region)  # (n, *chunk)
        flat = stacked(self.forward, blocks).reshape(len(blocks), -1)  # (n, chunk_numel)
        indices = flat.abs().topk(min(topk, flat.shape[1]), dim=1).indices  # (n, k)
        # ascending in each row: the receiver then sees them distinct in one read (``check``)
        indices = indices.sort(dim=1).values
        kept = flat.gather(1, indices)
        if value_bits:  # the values the codes stand for, float32, and the scales
            kept, scales = quantize(kept, value_bits)
            return Encoded(grid.chunk, grid.chunk_ids(region), indices, kept, scales)
        return Encoded(grid.chunk, grid.chunk_ids(region), indices, kept.to(value_dtype))

    def decode(self, result: SparseResult) -> Tensor:
        grid = ChunkGrid(shape=result.shape, chunk=result.chunk)
        shape = (math.prod(grid.region_counts(result.region)), grid.chunk_numel)
        flat = torch.zeros(shape, device=result.values.device)  # every chunk of the region
        sent = torch.zeros((len(result.chunks), grid.chunk_numel), device=flat.device)
        sent.scatter_(1, result.indices.long(), result.values.float())  # any integer dtype
        flat[grid.locate(result.chunks, result.region)] = sent  # chunks not sent stay zero
        return grid.assemble(stacked(self.inverse, flat.reshape(-1, *grid.chunk)),
                             result.region)

    def check(self, result: SparseResult) -> None:
        name, chunks, indices = result.name, result.chunks, result.indices
        grid = self._layout(result)
        if (seen := _outside(chunks, grid.size)) is not None:
            raise ChunkIdError(
                f"{name}: chunk ids must lie in [0, {grid.size}) for shape {result.shape} and "
                f"chunk {result.chunk}, got {seen}.")
        if chunks.numel() and not _every_chunk(grid, result.region, chunks):
            at = grid.locate(chunks, result.region)
            if bool((at < 0).any()):
                raise ChunkIdError(
                    f"{name}: a chunk id lies outside region {result.region}; send only "
                    "chunks the region touches.")
            if int(torch.bincount(at).max()) > 1:
                raise ChunkIdError(f"{name}: a chunk id is repeated; send each chunk once.")
        if (seen := _outside(indices, grid.chunk_numel)) is not None:
            raise ChunkIndexError(
                f"{name}: positions inside a chunk must lie in [0, {grid.chunk_numel}) for "
                f"chunk {result.chunk}, got {seen}.")
        # ascending rows (as ``encode`` and a relay send them) are distinct in one read; any
        # other order (a result logged before rows were sent ascending) is sorted first
        if indices.shape[1] > 1 and not bool((indices[:, 1:] > indices[:, :-1]).all()):
            ordered = indices.sort(dim=1).values
            if (ordered[:, 1:] == ordered[:, :-1]).any():
                raise ChunkIndexError(
                    f"{name}: a position is repeated within a chunk; send it once.")

    def all_valid(self, results: Sequence[SparseResult]) -> bool:
        """``check``'s reads done once over all of ``results`` where they take the common
        form (every chunk of the region in order, ascending positions): a submission's
        hundred parameters in a handful of reads, not five each. False as soon as one does
        not pass; then ``check`` of each says which and why."""
        try:
            grids = [self._layout(result) for result in results]
        except CompressionError:
            return False
        sent, expected, by_width = [], [], {}
        for result, grid in zip(results, grids, strict=True):
            ids = _region_ids(grid.shape, grid.chunk, result.region)
            if len(result.chunks) != len(ids):
                return False
            sent.append(result.chunks.to(torch.int64))
            expected.append(ids)
            if result.indices.numel():
                by_width.setdefault((grid.chunk_numel, result.indices.shape[1]), []).append(
                    result.indices)
        if sent and not torch.equal(torch.cat(sent), torch.cat(expected)):
            return False
        for (numel, k), group in by_width.items():
            rows = torch.cat(group)
            low, high = (int(x) for x in torch.aminmax(rows))
            if low < 0 or high >= numel or (
                    k > 1 and not bool((rows[:, 1:] > rows[:, :-1]).all())):
                return False
        return True

    def _layout(self, result: SparseResult) -> ChunkGrid:
        """The result's grid, once chunk, region, ids', positions' and values' shapes are
        consistent with it (ResultShapeMismatch else); reads no tensor's values."""
        name, chunks, indices = result.name, result.chunks, result.indices
        if len(result.chunk) != len(result.shape) or not all(
            1 <= c <= n for c, n in zip(result.chunk, result.shape, strict=False)
        ):
            raise ResultShapeMismatch(
                f"{name}: chunk {result.chunk} does not fit shape {result.shape}; give one size "
                "per dimension, each between 1 and that dimension."
            )
        grid = ChunkGrid(shape=result.shape, chunk=result.chunk)
        grid.check_region(result.region)
        if not _is_integer(chunks) or chunks.ndim != 1:
            raise ResultShapeMismatch(f"{name}: chunks must be a 1-D integer tensor.")
        if not _is_integer(indices) or indices.ndim != 2 or len(indices) != len(chunks):
            raise ResultShapeMismatch(
                f"{name}: indices must be an integer tensor of shape ({len(chunks)}, k), one row "
                f"per chunk, got {indices.dtype} {tuple(indices.shape)}."
            )
        _check_values_shape(result, tuple(indices.shape))
        return grid


def _each_valid(check: Callable[[SparseResult], None], results: Sequence[SparseResult]) -> bool:
    try:
        for result in results:
            check(result)
    except CompressionError:
        return False
    return True


def _every_chunk(grid: ChunkGrid, region: Region, chunks: Tensor) -> bool:
    """Whether ``chunks`` are every chunk of ``region`` in order, as ``encode`` sends them
    (then they lie inside it, each once: one comparison instead of ``locate``)."""
    expected = _region_ids(grid.shape, grid.chunk, region)
    return len(chunks) == len(expected) and torch.equal(chunks.to(torch.int64), expected)


@functools.lru_cache(maxsize=4096)
def _region_ids(shape: tuple[int, ...], chunk: tuple[int, ...], region: Region) -> Tensor:
    return ChunkGrid(shape=shape, chunk=chunk).chunk_ids(region)


def _is_integer(tensor: Tensor) -> bool:
    dtype = tensor.dtype
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def _check_values_shape(result: SparseResult, expected: tuple[int, ...]) -> None:
    if tuple(result.values.shape) != expected:
        raise ResultShapeMismatch(
            f"{result.name}: values of shape {tuple(result.values.shape)} should have shape "
            f"{expected} for encoding {result.encoding!r} and region {result.region}."
        )


def _identity(values: Tensor, chunk: tuple[int, ...]) -> Tensor:
    return values


ENCODERS: dict[str, Encoding] = {
    "dense": Dense(),
    "topk": ChunkTopK(forward=_identity, inverse=_identity),
    "dct": ChunkTopK(forward=chunkwise_dct, inverse=chunkwise_idct),
}


def get_encoding(name: str) -> Encoding:
    try:
        return ENCODERS[name]
    except KeyError:
        raise UnknownEncoding(f"unknown encoding {name!r}: {did_you_mean(name, ENCODERS)}"
                              f"registered: {', '.join(ENCODERS)}.") from None


def decode(result: SparseResult) -> Tensor:
    """The region-shaped float32 values of a result (not validated: see ``validate``)."""
    return get_encoding(result.encoding).decode(result)


def _outside(ids: Tensor, bound: int) -> str | None:
    """"low..high" of integer ``ids`` when some lie outside [0, ``bound``); one read."""
    if not ids.numel():
        return None
    low, high = (int(x) for x in torch.aminmax(ids))
    return f"{low}..{high}" if low < 0 or high >= bound else None
