"""Bytes a sparse result needs on the wire.

In memory, chunk ids and positions are int64; on the wire each needs only the smallest
signed integer type that holds its range: positions inside a 64 × 64 chunk (< 4096) fit in
int16, inside a 64-long 1-D chunk in int8; chunk ids are bounded by the grid's chunk count.
Values travel in their own dtype (bfloat16 by default for topk/dct, see ``compressor.py``), or
as low-bit codes packed to their bits with a float32 scale per chunk (``quantize.py``).
Fixed fields (name, shape, region, chunk, tokens) are a few dozen bytes and not counted.
The broadcast's positions are packed to the bits they need (``pack_bits``): 12 for 4096.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from matformer.modeling.compression.grid import ChunkGrid
from matformer.modeling.compression.sparse import SparseResult

_SIGNED = (torch.int8, torch.int16, torch.int32, torch.int64)
# what ratios of bytes moved are taken against: float32 tensors of whole regions
DENSE_BYTES_PER_VALUE = 4


def index_dtype(bound: int) -> torch.dtype:
    """The smallest signed integer dtype that holds every value in [0, bound)."""
    return next(dtype for dtype in _SIGNED if bound - 1 <= torch.iinfo(dtype).max)


def payload_bytes(result: SparseResult) -> int:
    """Bytes of chunk ids, positions and values at their wire dtypes (low-bit values: their
    codes, packed, and a float32 scale per chunk)."""
    values = result.values.numel() * result.values.element_size()
    if result.value_bits:
        values = -(-result.values.numel() * result.value_bits // 8) + 4 * len(result.chunks)
    if not result.chunks.numel():  # dense (or no chunk sent): values only
        return values
    grid = ChunkGrid(shape=result.shape, chunk=result.chunk)
    ids = result.chunks.numel() * index_dtype(grid.size).itemsize
    positions = result.indices.numel() * index_dtype(grid.chunk_numel).itemsize
    return ids + positions + values


def position_bits(chunk_numel: int) -> int:
    """Bits a position inside a chunk of ``chunk_numel`` elements needs."""
    return max(1, math.ceil(math.log2(chunk_numel)))


def pack_bits(values: torch.Tensor, bits: int) -> bytes:
    """Non-negative integers below 2^bits, ``bits`` each, little-endian, in ⌈n·bits / 8⌉
    bytes (the last byte zero-padded)."""
    flat = values.reshape(-1).to(torch.int64).numpy().astype(np.uint32)
    planes = (flat[:, None] >> np.arange(bits, dtype=np.uint32)) & 1  # (n, bits), low bit first
    return np.packbits(planes.astype(np.uint8).reshape(-1), bitorder="little").tobytes()


def unpack_bits(data: bytes, bits: int, count: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: (count,) int64. Raises ValueError when ``data`` is not
    exactly the size ``count`` values need."""
    need = -(-count * bits // 8)
    if len(data) != need:
        raise ValueError(f"{count} values of {bits} bits take {need} bytes, got {len(data)}.")
    planes = np.unpackbits(np.frombuffer(data, dtype=np.uint8), bitorder="little")
    planes = planes[:count * bits].reshape(count, bits).astype(np.int64)
    return torch.from_numpy((planes << np.arange(bits, dtype=np.int64)).sum(axis=1))
