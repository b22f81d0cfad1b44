"""``SparseResult`` ↔ message, field by field.

Chunk ids and positions are int64 in memory but travel in the smallest signed integer dtype
that holds their range (``modeling.compression.index_dtype``: int16 for positions in a 64 × 64
chunk), so the bytes sent are what ``payload_bytes`` counts. Decoding widens any integer
dtype back to int64 and then runs ``modeling.compression.validate``, so a decoded result is
always one the coordinator can aggregate; any failure is a ``MalformedSparseResult``.
"""

from __future__ import annotations

import torch

from modeling.compression import ChunkGrid, SparseResult, index_dtype, validate
from modeling.errors import CompressionError
from protocol.errors import MalformedSparseResult
from protocol.matformer.v1 import coordinator_pb2 as pb
from protocol.tensors import decode_tensor, encode_tensor

_TENSOR_FIELDS = ("chunks", "indices", "values")


def encode_sparse_result(result: SparseResult) -> pb.SparseResult:
    chunks, indices = result.chunks, result.indices
    if result.chunk:  # topk / dct: narrow ids and positions to what their bounds need
        grid = ChunkGrid(shape=result.shape, chunk=result.chunk)
        chunks = chunks.to(index_dtype(grid.size))
        indices = indices.to(index_dtype(grid.chunk_numel))
    return pb.SparseResult(
        name=result.name,
        shape=result.shape,
        region=[pb.Range(start=start, stop=stop) for start, stop in result.region],
        encoding=result.encoding,
        chunk=result.chunk,
        chunks=encode_tensor(chunks),
        indices=encode_tensor(indices),
        values=encode_tensor(result.values),
        tokens=result.tokens,
    )


def decode_sparse_result(message: pb.SparseResult) -> SparseResult:
    """Message → a validated ``SparseResult``; raises a ``ProtocolError`` subclass if the
    message is malformed or the result inconsistent (region, ids, positions, NaN, tokens)."""
    what = f"sparse result {message.name!r}"
    missing = [field for field in _TENSOR_FIELDS if not message.HasField(field)]
    if missing:
        raise MalformedSparseResult(f"{what} has no {', '.join(missing)}.")
    result = SparseResult(
        name=message.name,
        shape=tuple(message.shape),
        region=tuple((r.start, r.stop) for r in message.region),
        encoding=message.encoding,
        chunk=tuple(message.chunk),
        chunks=_as_int64(decode_tensor(message.chunks, f"{what}: chunks"), f"{what}: chunks"),
        indices=_as_int64(decode_tensor(message.indices, f"{what}: indices"), f"{what}: indices"),
        values=decode_tensor(message.values, f"{what}: values"),
        tokens=message.tokens,
    )
    try:
        validate(result)
    except CompressionError as err:
        raise MalformedSparseResult(f"{what} is inconsistent: {err}") from err
    return result


def _as_int64(tensor: torch.Tensor, what: str) -> torch.Tensor:
    if tensor.dtype.is_floating_point or tensor.dtype == torch.bool:
        raise MalformedSparseResult(f"{what} are {tensor.dtype}; ids and positions are integers.")
    return tensor.to(torch.int64)
