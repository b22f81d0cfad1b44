"""``SparseResult`` ↔ message, field by field, and the gate a received one passes first.

Chunk ids and positions are int64 in memory but travel in the smallest signed integer dtype
that holds their range (``modeling.compression.index_dtype``: int16 for positions in a 64 × 64
chunk), so the bytes sent are what ``payload_bytes`` counts.

A received message is checked against the ``ResultLayout`` the run expects for its parameter
before any of its tensors is decoded: shape, region, encoding and chunk as the run's, every
tensor's dtype and declared shape within the run's grid and topk. Only then are its bytes
read, ids and positions widened to int64 (so widening costs at most what an honest result of
that parameter costs, never what a message declares), and the result checked by
``modeling.compression.validate``. Any failure is a ``ProtocolError``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from matformer.modeling.compression import (
    ChunkGrid,
    Compressor,
    Region,
    SparseResult,
    ValidResult,
    index_dtype,
    pack_bits,
    region_shape,
    unpack_bits,
    validate,
    validate_all,
)
from matformer.modeling.compression.quantize import code_range, codes_of, dequantize
from matformer.modeling.errors import CompressionError
from matformer.protocol.errors import LayoutMismatch, MalformedSparseResult
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.tensors import DTYPES, decode_tensor, dtype_name, encode_tensor

_TENSOR_FIELDS = ("chunks", "indices", "values")
_INTEGER = {name for name, dtype in DTYPES.items()
            if not dtype.is_floating_point and dtype != torch.bool}


@dataclass(frozen=True, slots=True)
class ResultLayout:
    """What the run accepts as one parameter's result from a client of one tier."""

    shape: tuple[int, ...]  # the parameter's universal shape
    region: Region  # the client's tier region of it
    encoding: str  # the run's encoding
    chunk: tuple[int, ...]  # the run's chunk on this parameter's grid; () for dense
    topk: int  # values per chunk at most (topk, dct)
    value_dtype: str  # the values' dtype name (protocol.tensors.DTYPES)
    value_bits: int = 0  # low-bit values: codes of this many bits, packed, and scales

    @property
    def max_chunks(self) -> int:
        """Chunks the region touches: the most a result may send (none for dense)."""
        if not self.chunk:
            return 0
        return math.prod(ChunkGrid(shape=self.shape, chunk=self.chunk).region_counts(self.region))

    @property
    def per_chunk(self) -> int:
        """Values per chunk at most."""
        return min(self.topk, math.prod(self.chunk)) if self.chunk else 0


def result_layouts(compressor: Compressor, shapes: Mapping[str, tuple[int, ...]],
                   regions: Mapping[str, Region]) -> dict[str, ResultLayout]:
    """Each parameter's layout for a client whose tier covers ``regions``."""
    dense = compressor.encoding_name == "dense"
    values = compressor.momentum_dtype if dense else compressor.value_dtype
    return {name: ResultLayout(
        shape=tuple(shape), region=tuple((start, stop) for start, stop in regions[name]),
        encoding=compressor.encoding_name,
        chunk=() if dense else ChunkGrid.of(shape, compressor.chunk).chunk,
        topk=compressor.topk, value_dtype=dtype_name(values),
        value_bits=0 if dense else compressor.value_bits) for name, shape in shapes.items()}


def partial_layouts(compressor: Compressor, shapes: Mapping[str, tuple[int, ...]],
                    tier_regions: Mapping[int, Mapping[str, Region]]
                    ) -> dict[tuple[str, Region], ResultLayout]:
    """What the run accepts from a relay (``modeling.compression.partial``): for each
    parameter and each tier's region of it, float32 values and up to a whole chunk of
    positions per chunk; keyed by (name, region)."""
    layouts: dict[tuple[str, Region], ResultLayout] = {}
    for regions in tier_regions.values():
        for name, layout in result_layouts(compressor, shapes, regions).items():
            wide = dataclasses.replace(layout, value_dtype="float32", value_bits=0,
                                       topk=math.prod(layout.chunk) if layout.chunk else 0)
            layouts[name, layout.region] = wide
    return layouts


def encode_sparse_result(result: SparseResult) -> pb.SparseResult:
    chunks, indices, values = result.chunks, result.indices, result.values
    if result.chunk:  # topk / dct: narrow ids and positions to what their bounds need
        grid = ChunkGrid(shape=result.shape, chunk=result.chunk)
        chunks = chunks.to(index_dtype(grid.size))
        indices = indices.to(index_dtype(grid.chunk_numel))
    scales = None
    if result.value_bits:  # the codes the values stand on, packed, and the scales
        bits = result.value_bits
        codes = codes_of(values.cpu(), result.scales.cpu(), bits).to(torch.int64)
        packed = pack_bits(codes - code_range(bits)[0], bits)
        values = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
        scales = encode_tensor(result.scales.float())
    return pb.SparseResult(
        name=result.name,
        shape=result.shape,
        region=[pb.Range(start=start, stop=stop) for start, stop in result.region],
        encoding=result.encoding,
        chunk=result.chunk,
        chunks=encode_tensor(chunks),
        indices=encode_tensor(indices),
        values=encode_tensor(values),
        tokens=result.tokens,
        scales=scales,
    )


def decode_sparse_result(message: pb.SparseResult, layout: ResultLayout) -> ValidResult:
    """Message → a ``ValidResult`` (validated here, once, for everything after); raises a
    ``ProtocolError`` subclass if the message does not have the run's ``layout`` (checked
    before anything is decoded) or the result is inconsistent (ids, positions, NaN,
    tokens)."""
    (result,) = decode_sparse_results([message], [layout])
    return result


def decode_sparse_results(messages: Sequence[pb.SparseResult],
                          layouts: Sequence[ResultLayout]) -> list[ValidResult]:
    """``decode_sparse_result`` of each message with its layout, checked together
    (``validate_all``): every layout before any tensor is decoded, so a batch with one
    wrong message decodes nothing, then the tensors in a few reads over all of them."""
    for message, layout in zip(messages, layouts, strict=True):
        check_layout(message, layout)
    results = [_decoded(m, layout) for m, layout in zip(messages, layouts, strict=True)]
    try:
        return validate_all(results)
    except CompressionError:
        pass  # one of them is bad: validated one by one, the first bad one is named
    for result in results:
        try:
            validate(result)
        except CompressionError as err:
            raise MalformedSparseResult(
                f"sparse result {result.name!r} is inconsistent: {err}") from err
    raise AssertionError("unreachable: validate_all failed on results that each validate")


def _decoded(message: pb.SparseResult, layout: ResultLayout) -> SparseResult:
    what = f"sparse result {message.name!r}"
    indices = decode_tensor(message.indices, f"{what}: indices").to(torch.int64)
    values = decode_tensor(message.values, f"{what}: values")
    scales = None
    if layout.value_bits:  # the float32 values the codes stand for, as the sender kept them
        scales = decode_tensor(message.scales, f"{what}: scales")
        if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
            raise MalformedSparseResult(f"{what}: scales must be finite and >= 0.")
        bits = layout.value_bits
        codes = unpack_bits(values.numpy().tobytes(), bits, indices.numel())
        values = dequantize((codes + code_range(bits)[0]).reshape(indices.shape), scales)
    return SparseResult(
        name=message.name,
        shape=layout.shape,
        region=layout.region,
        encoding=message.encoding,
        chunk=layout.chunk,
        chunks=decode_tensor(message.chunks, f"{what}: chunks").to(torch.int64),
        indices=indices,
        values=values,
        tokens=message.tokens,
        value_bits=layout.value_bits,
        scales=scales,
    )


def check_layout(message: pb.SparseResult, layout: ResultLayout) -> None:
    """LayoutMismatch (or MalformedSparseResult for a missing tensor) unless every field and
    tensor header of ``message`` is what ``layout`` allows; reads no tensor's bytes."""
    what = f"sparse result {message.name!r}"
    missing = [field for field in _TENSOR_FIELDS if not message.HasField(field)]
    if missing:
        raise MalformedSparseResult(f"{what} has no {', '.join(missing)}.")
    region = tuple((r.start, r.stop) for r in message.region)
    declared = (tuple(message.shape), region, message.encoding, tuple(message.chunk))
    if declared != (layout.shape, layout.region, layout.encoding, layout.chunk):
        raise LayoutMismatch(
            f"{what} has shape {list(declared[0])}, region {list(region)}, encoding "
            f"{message.encoding[:20]!r} and chunk {list(declared[3])}; this client sends shape "
            f"{list(layout.shape)}, region {list(layout.region)}, encoding {layout.encoding!r} "
            f"and chunk {list(layout.chunk)} (take the settings from JoinReply, or rejoin).")
    chunks, indices, values = message.chunks, message.indices, message.values
    for tensor, field in ((chunks, "chunks"), (indices, "indices")):
        if tensor.dtype not in _INTEGER:
            raise LayoutMismatch(f"{what}: {field} are {tensor.dtype[:20]!r}; ids and "
                                 "positions are integers.")
    n = chunks.shape[0] if len(chunks.shape) == 1 else -1
    k = indices.shape[1] if len(indices.shape) == 2 and indices.shape[0] == n else -1
    fits = 0 <= n <= layout.max_chunks and 0 <= k <= layout.per_chunk
    expected = region_shape(layout.region) if not layout.chunk else (n, k)
    dtype = layout.value_dtype
    if layout.value_bits:  # the codes, packed, and a scale per chunk
        expected, dtype = (-(-max(n, 0) * max(k, 0) * layout.value_bits // 8),), "uint8"
        scales = message.scales
        if not message.HasField("scales") or scales.dtype != "float32" or tuple(
                scales.shape) != (n,):
            raise LayoutMismatch(
                f"{what} declares scales {scales.dtype[:20]} {list(scales.shape)}; the run's "
                f"{layout.value_bits}-bit values need one float32 scale per chunk sent ({n}).")
    elif message.HasField("scales"):
        raise LayoutMismatch(f"{what} has scales, but the run's values are "
                             f"{layout.value_dtype}, not low-bit codes.")
    if not fits or tuple(values.shape) != expected or values.dtype != dtype:
        raise LayoutMismatch(
            f"{what} declares chunks {list(chunks.shape)}, indices {list(indices.shape)} and "
            f"{values.dtype[:20]} values {list(values.shape)}; the run takes at most "
            f"{layout.max_chunks} chunks of at most {layout.per_chunk} "
            f"{f'{layout.value_bits}-bit' if layout.value_bits else layout.value_dtype} values "
            "for it. Send results encoded with the run's settings.")


class ResultLayouts:
    """What a run accepts of each parameter, built once each: from a member at ``tier``
    (``of``), and from a relay, per parameter and tier region (``partials``)."""

    def __init__(self, compressor: Compressor, shapes: Mapping[str, tuple[int, ...]],
                 regions: Callable[[int], Mapping[str, Region]], tiers: Sequence[int]) -> None:
        self.compressor, self.shapes, self.regions, self.tiers = compressor, shapes, regions, tiers
        self._by_tier: dict[int, dict[str, ResultLayout]] = {}
        self._partials: dict[tuple[str, Region], ResultLayout] | None = None

    def of(self, tier: int) -> dict[str, ResultLayout]:
        if tier not in self._by_tier:
            self._by_tier[tier] = result_layouts(self.compressor, self.shapes,
                                                 self.regions(tier))
        return self._by_tier[tier]

    def partials(self) -> dict[tuple[str, Region], ResultLayout]:
        if self._partials is None:
            self._partials = partial_layouts(self.compressor, self.shapes,
                                             {t: self.regions(t) for t in self.tiers})
        return self._partials
