"""A named sparse result: what a client sends for one parameter after a round.

It is the one shape of gradient information that crosses the wire (``protocol/`` converts it
to and from messages): the parameter's canonical name and universal shape, the region of the
universal tensor the client's tier covers, and the encoded values. Chunks are cut on the
universal tensor's grid, so the chunks of a tier slice are the universal tensor's own chunks
and results of clients at different tiers add up element by element.

A region that ends inside a chunk (or a tensor whose size the chunk does not divide) leaves a
partial edge chunk: ``indices`` still number positions of the full chunk shape, and positions
outside the region are dropped on decoding (``grid.py``). ``values`` travel in the dtype the
encoder chose (``CompressionConfig.value_dtype``, bfloat16 by default; dense: the momentum's
own float32), so error feedback subtracts exactly what was sent; low-bit values are kept as
the float32 values their codes stand for, with a scale per chunk. ``tokens`` must be >= 1.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True, slots=True)
class SparseResult:
    name: str  # canonical parameter name, e.g. "model.layers.0.mlp.up_proj.weight"
    shape: tuple[int, ...]  # the parameter's universal (tier-0) shape
    region: tuple[tuple[int, int], ...]  # [start, stop) per dimension that this result covers
    encoding: str  # a name in encodings.ENCODERS: dense | topk | dct
    chunk: tuple[int, ...]  # chunk shape on the universal grid; () for "dense"
    chunks: Tensor  # (n,) int64 ids of the chunks sent, row-major on the universal grid
    indices: Tensor  # (n, k) int64 positions inside each chunk (row-major); empty for "dense"
    values: Tensor  # (n, k) values; for "dense" the region's values, shaped like the region
    tokens: int  # training tokens behind this result (the aggregation weight)
    # low-bit values ([compression] value_dtype int2 / int4 / int8): ``values`` are the
    # float32 values the codes stand for, with each chunk's (n,) float32 scale; the wire
    # carries the codes (modeling/compression/quantize.py)
    value_bits: int = 0
    scales: Tensor | None = None
