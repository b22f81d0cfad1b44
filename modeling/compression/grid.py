"""The chunk grid of a parameter: fixed-size chunks cut on its universal shape.

Chunks tile the universal tensor from index 0 along every dimension, so a tier slice (a
region starting at 0) is cut into the universal tensor's own chunks. A chunk that runs past
the end of the tensor or of a region is a *partial edge chunk*: it keeps the full chunk
shape, the positions outside are zeros when encoding and are dropped when decoding. So
tier 1 of a 192-wide FFN with chunk 64 covers rows [0, 96): chunk 0 whole, chunk 1 in its
first 32 rows, and a tier-0 client's chunk 1 is the same chunk, whole.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from matformer.modeling.errors import CompressionConfigError, RegionError

Region = tuple[tuple[int, int], ...]  # [start, stop) per dimension of the universal shape


def full_region(shape: Sequence[int]) -> Region:
    return tuple((0, size) for size in shape)


def region_shape(region: Region) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in region)


def region_slices(region: Region) -> tuple[slice, ...]:
    """Index a universal-shaped tensor with this to get the region: ``tensor[slices]``."""
    return tuple(slice(start, stop) for start, stop in region)


@dataclass(frozen=True, slots=True)
class ChunkGrid:
    shape: tuple[int, ...]  # the parameter's universal shape
    chunk: tuple[int, ...]  # chunk shape, one size per dimension

    @classmethod
    def of(cls, shape: Sequence[int], size: int) -> ChunkGrid:
        """Chunks of ``size`` along every dimension, clipped to dimensions that are smaller."""
        if size < 1:
            raise CompressionConfigError(f"chunk size must be >= 1, got {size}.")
        shape = tuple(shape)
        return cls(shape=shape, chunk=tuple(min(size, n) for n in shape))

    def __post_init__(self) -> None:
        if len(self.chunk) != len(self.shape) or not all(c >= 1 for c in self.chunk):
            raise CompressionConfigError(
                f"chunk {self.chunk} does not fit shape {self.shape}: it needs one size >= 1 "
                "per dimension."
            )

    @property
    def counts(self) -> tuple[int, ...]:
        """Chunks along each dimension, partial edge chunks included."""
        return _counts(self.shape, self.chunk)

    @property
    def size(self) -> int:
        """Number of chunks in the whole grid."""
        return math.prod(_counts(self.shape, self.chunk))

    @property
    def chunk_numel(self) -> int:
        return math.prod(self.chunk)

    def check_region(self, region: Region) -> None:
        """Raise RegionError unless ``region`` lies inside the shape and starts on the grid."""
        if len(region) != len(self.shape) or any(len(pair) != 2 for pair in region):
            raise RegionError(
                f"region {region} does not fit shape {self.shape}: give one [start, stop) pair "
                "per dimension."
            )
        for dim, ((start, stop), size, chunk) in enumerate(
            zip(region, self.shape, self.chunk, strict=True)
        ):
            if not 0 <= start < stop <= size:
                raise RegionError(
                    f"region {region} is empty or outside shape {self.shape} in dimension "
                    f"{dim}; each pair must satisfy 0 <= start < stop <= size."
                )
            if start % chunk:
                raise RegionError(
                    f"region {region} starts at {start} in dimension {dim}, off the chunk grid "
                    f"(chunk {chunk}); start regions at a multiple of the chunk size."
                )

    def region_counts(self, region: Region) -> tuple[int, ...]:
        """Chunks the region touches along each dimension."""
        return tuple(
            -(-stop // c) - start // c for (start, stop), c in zip(region, self.chunk, strict=True)
        )

    def chunk_ids(self, region: Region) -> Tensor:
        """(n,) int64 ids of the chunks the region touches, row-major on the whole grid."""
        ids = torch.zeros((), dtype=torch.int64)
        for (start, _), count, c, total in zip(
            region, self.region_counts(region), self.chunk, self.counts, strict=True
        ):
            along = torch.arange(start // c, start // c + count, dtype=torch.int64)
            ids = (ids * total).unsqueeze(-1) + along  # grows one grid dimension per step
        return ids.reshape(-1)

    def locate(self, ids: Tensor, region: Region) -> Tensor:
        """Position of each chunk id in ``chunk_ids(region)`` order; -1 where the chunk lies
        outside the region. ``ids`` must lie in [0, size)."""
        counts = self.region_counts(region)
        position = torch.zeros_like(ids)
        inside = torch.ones_like(ids, dtype=torch.bool)
        rest = ids
        stride = 1
        for (start, _), count, c, total in reversed(
            list(zip(region, counts, self.chunk, self.counts, strict=True))
        ):
            along = rest % total - start // c  # grid coordinate, relative to the region
            rest = rest // total
            inside &= (along >= 0) & (along < count)
            position += along * stride
            stride *= count
        return torch.where(inside, position, -1)

    def padded(self, region: Region) -> tuple[int, ...]:
        """Shape of the chunks ``region`` touches laid out chunkwise (as their values lie, each
        partial edge chunk whole): the region's shape rounded up to whole chunks."""
        return tuple(n * c for n, c in zip(self.region_counts(region), self.chunk, strict=True))

    def flat_index(self, region: Region, ids: Tensor, positions: Tensor) -> Tensor:
        """Index into a flattened tensor of shape ``padded(region)`` (the region's chunks laid
        out chunkwise) of position ``positions`` (row-major inside a chunk) of chunk ``ids``
        (on the whole grid, touched by the region); ``ids`` broadcasts against ``positions``:
        where the chunk starts plus where the position lies from there."""
        return self.chunk_starts(region, ids) + self.offsets(region, positions.device)[positions]

    def chunk_starts(self, region: Region, ids: Tensor) -> Tensor:
        """``flat_index`` of the first element of each chunk ``ids``."""
        strides = _strides(self.padded(region))
        start = torch.zeros_like(ids)
        rest = ids
        for dim in reversed(range(len(self.chunk))):
            along = rest % self.counts[dim] - region[dim][0] // self.chunk[dim]
            start += along * (self.chunk[dim] * strides[dim])
            rest = rest // self.counts[dim]
        return start

    def offsets(self, region: Region, device: torch.device | str = "cpu") -> Tensor:
        """(chunk_numel,) int64: where each position of a chunk (row-major) lies from the
        chunk's first element in a flattened tensor of shape ``padded(region)``."""
        return _offsets(self.chunk, self.padded(region)).to(device)

    def blocks(self, values: Tensor, region: Region) -> Tensor:
        """Cut region-shaped ``values`` into (n, *chunk) chunks, zero-padded at partial edges,
        in the order of ``chunk_ids(region)``."""
        counts = self.region_counts(region)
        pad = []
        for size, count, c in zip(values.shape, counts, self.chunk, strict=True):
            pad = [0, count * c - size, *pad]  # F.pad lists the last dimension first
        padded = F.pad(values, pad)
        split = [n for pair in zip(counts, self.chunk, strict=True) for n in pair]
        ndim = len(counts)
        # (n0, c0, n1, c1, ...) → (n0, n1, ..., c0, c1, ...)
        order = [2 * d for d in range(ndim)] + [2 * d + 1 for d in range(ndim)]
        return padded.reshape(split).permute(order).reshape(-1, *self.chunk)

    def assemble(self, blocks: Tensor, region: Region) -> Tensor:
        """Inverse of ``blocks``: (n, *chunk) chunks → region-shaped tensor, padding dropped."""
        counts = self.region_counts(region)
        ndim = len(counts)
        # (n0, n1, ..., c0, c1, ...) → (n0, c0, n1, c1, ...)
        order = [i for d in range(ndim) for i in (d, ndim + d)]
        grid = blocks.reshape(*counts, *self.chunk).permute(order)
        padded = grid.reshape([n * c for n, c in zip(counts, self.chunk, strict=True)])
        return padded[tuple(slice(0, size) for size in region_shape(region))]


@functools.lru_cache(maxsize=4096)
def _counts(shape: tuple[int, ...], chunk: tuple[int, ...]) -> tuple[int, ...]:
    """``ChunkGrid.counts``, worked out once per grid (every result asks, many times)."""
    return tuple(-(-n // c) for n, c in zip(shape, chunk, strict=True))


def _strides(shape: Sequence[int]) -> list[int]:
    """Row-major strides of a contiguous tensor of ``shape``, in elements."""
    return [math.prod(shape[dim + 1:]) for dim in range(len(shape))]


@functools.cache
def _offsets(chunk: tuple[int, ...], padded: tuple[int, ...]) -> Tensor:
    """``ChunkGrid.offsets``, made once per chunk and padded shape (every result of a
    parameter, every round, asks for the same)."""
    offsets = torch.zeros((), dtype=torch.int64)
    for c, stride in zip(chunk, _strides(padded), strict=True):
        offsets = offsets.unsqueeze(-1) + torch.arange(c) * stride
    return offsets.reshape(-1)
