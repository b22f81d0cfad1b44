"""SparseResult ↔ message field by field, decode checks, and the submission stream (the update
stream: test_update_steps.py)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from modeling.compression import (
    CompressionConfig,
    SparseResult,
    payload_bytes,
)
from protocol.errors import (
    MalformedSparseResult,
    MalformedStream,
    TooManyResults,
    UnknownDtype,
)
from protocol.matformer.v1 import coordinator_pb2 as pb
from protocol.sparse import decode_sparse_result, encode_sparse_result
from protocol.submission import read_submission, submission_messages
from protocol.tensors import encode_tensor

UP = "model.layers.0.mlp.up_proj.weight"
SHAPE = (16, 12)  # universal up_proj; tier 1 covers rows [0, 8)
TIER1 = ((0, 8), (0, 12))


def _result(encoding: str, region=TIER1, tokens: int = 512, **settings) -> SparseResult:
    values = torch.randn(region[0][1] - region[0][0], region[1][1] - region[1][0])
    compressor = CompressionConfig(encoding=encoding, chunk=4, topk=3, **settings).build()
    return compressor.encode(UP, values, shape=SHAPE, region=region, tokens=tokens)


DENSE = _result("dense")
TOPK = _result("topk", value_dtype="float32")
DCT = _result("dct")  # bfloat16 values by default


def _assert_same(a: SparseResult, b: SparseResult) -> None:
    for field in dataclasses.fields(SparseResult):
        left, right = getattr(a, field.name), getattr(b, field.name)
        if isinstance(left, torch.Tensor):
            assert left.dtype == right.dtype and torch.equal(left, right), field.name
        else:
            assert left == right and type(left) is type(right), field.name


def _through_wire(result: SparseResult) -> SparseResult:
    wire = encode_sparse_result(result).SerializeToString()
    return decode_sparse_result(pb.SparseResult.FromString(wire))


@pytest.mark.parametrize("result", [DENSE, TOPK, DCT], ids=["dense", "topk", "dct"])
def test_round_trip_field_by_field(result: SparseResult) -> None:
    _assert_same(_through_wire(result), result)


def test_ids_and_positions_travel_narrow_and_arrive_as_int64() -> None:
    message = encode_sparse_result(DCT)  # 4 × 3 grid of 4 × 4 chunks: both bounds fit int8
    assert (message.chunks.dtype, message.indices.dtype, message.values.dtype) == (
        "int8", "int8", "bfloat16")
    sent = sum(len(t.data) for t in (message.chunks, message.indices, message.values))
    assert sent == payload_bytes(DCT)
    decoded = decode_sparse_result(message)
    assert decoded.chunks.dtype == decoded.indices.dtype == torch.int64


def test_message_fields_mirror_the_dataclass() -> None:
    message = encode_sparse_result(TOPK)
    assert (message.name, message.encoding, message.tokens) == (UP, "topk", 512)
    assert list(message.shape) == [16, 12] and list(message.chunk) == [4, 4]
    assert [(r.start, r.stop) for r in message.region] == [(0, 8), (0, 12)]


def test_a_non_contiguous_dense_region_travels() -> None:
    full = torch.randn(16, 12)
    result = dataclasses.replace(DENSE, region=((0, 16), (0, 6)), values=full[:, :6])
    assert torch.equal(_through_wire(result).values, full[:, :6])


def _ids(*ids: int) -> torch.Tensor:
    return torch.tensor(ids)


# Each is refused by modeling.compression.validate, run on every decoded result.
INCONSISTENT = {
    "unknown encoding": dict(encoding="zip"),
    "no tokens": dict(tokens=0),
    "region past shape": dict(region=((0, 20), (0, 12))),
    "region off the grid": dict(region=((2, 8), (0, 12))),
    "NaN": dict(values=torch.full_like(TOPK.values, float("nan"))),
    "infinity": dict(values=torch.full_like(TOPK.values, float("inf"))),
    "integer values": dict(values=TOPK.values.long()),
    "values shape": dict(values=TOPK.values[:, :2]),
    "chunk id past grid": dict(chunks=TOPK.chunks + 100),
    "repeated chunk id": dict(chunks=torch.zeros_like(TOPK.chunks)),
    "chunk outside region": dict(chunks=TOPK.chunks + 6),  # rows [8, 16): tier 0 only
    "position past chunk": dict(indices=TOPK.indices + 16),
    "flat indices": dict(indices=TOPK.indices.flatten()),
}


@pytest.mark.parametrize("changes", INCONSISTENT.values(), ids=INCONSISTENT.keys())
def test_inconsistent_results_are_refused(changes: dict) -> None:
    bad = dataclasses.replace(TOPK, **changes)
    wire = pb.SparseResult(  # as a faulty sender would write it: no narrowing, no checks
        name=bad.name, shape=bad.shape, encoding=bad.encoding, chunk=bad.chunk,
        region=[pb.Range(start=a, stop=b) for a, b in bad.region], tokens=bad.tokens,
        chunks=encode_tensor(bad.chunks), indices=encode_tensor(bad.indices),
        values=encode_tensor(bad.values),
    )
    with pytest.raises(MalformedSparseResult, match=f"result '{UP}' is inconsistent: "):
        decode_sparse_result(wire)


def test_wire_level_faults_are_refused() -> None:
    message = encode_sparse_result(TOPK)
    message.ClearField("values")
    with pytest.raises(MalformedSparseResult, match="no values"):
        decode_sparse_result(message)
    message = encode_sparse_result(TOPK)
    message.chunks.CopyFrom(encode_tensor(TOPK.chunks.float()))
    with pytest.raises(MalformedSparseResult, match=r"chunks are torch\.float32"):
        decode_sparse_result(message)
    message = encode_sparse_result(TOPK)
    message.indices.dtype = "int4"
    with pytest.raises(UnknownDtype, match=r"up_proj\.weight': indices"):
        decode_sparse_result(message)


def _header() -> pb.SubmitHeader:
    return pb.SubmitHeader(round=3, client_id="c1", tokens=512, loss=2.5, train_seconds=1.5)


def test_submission_round_trip() -> None:
    other = dataclasses.replace(DENSE, name="model.norm.weight", shape=(12,), region=((0, 12),),
                                values=torch.randn(12))
    header, results = read_submission(submission_messages(_header(), [DCT, other]),
                                      max_results=2)
    assert header == _header()
    received = list(results)
    _assert_same(received[0], DCT)
    _assert_same(received[1], other)


@pytest.mark.parametrize(("messages", "match"), [
    ([], "start with its SubmitHeader"),
    ([pb.SubmitMessage(result=encode_sparse_result(TOPK))], "start with its SubmitHeader"),
    ([pb.SubmitMessage(header=_header())] * 2, "one SubmitHeader"),
    (list(submission_messages(_header(), [TOPK, DENSE])), "submitted twice"),
])
def test_malformed_submissions_are_refused(messages: list, match: str) -> None:
    with pytest.raises(MalformedStream, match=match):
        list(read_submission(messages, max_results=8)[1])


def test_a_submission_holds_one_result_per_parameter_at_most() -> None:
    """The result over the model's parameter count is refused before it is decoded."""
    results = [dataclasses.replace(DENSE, name=f"p{i}") for i in range(3)]
    empty = pb.SubmitMessage(result=pb.SparseResult())
    messages = [*submission_messages(_header(), results), empty]
    _, stream = read_submission(messages, max_results=3)
    assert [r.name for r in itertools.islice(stream, 3)] == ["p0", "p1", "p2"]
    with pytest.raises(TooManyResults, match="more than 3 results"):
        next(stream)  # an empty message: decoding it would raise MalformedSparseResult


