"""SparseResult ↔ message field by field, decode checks, and the submission stream (the update
stream: test_update_steps.py)."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from matformer.modeling.compression import (
    CompressionConfig,
    SparseResult,
    payload_bytes,
)
from matformer.protocol.channel import BATCH_BYTES
from matformer.protocol.errors import (
    LayoutMismatch,
    MalformedSparseResult,
    MalformedStream,
)
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.sparse import (
    ResultLayout,
    decode_sparse_result,
    decode_sparse_results,
    encode_sparse_result,
)
from matformer.protocol.submission import read_results, read_submission, submission_messages
from matformer.protocol.tensors import dtype_name, encode_tensor

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


def _layout(result: SparseResult) -> ResultLayout:
    """The layout a run with ``_result``'s settings takes ``result`` in."""
    return ResultLayout(shape=result.shape, region=result.region, encoding=result.encoding,
                        chunk=result.chunk, topk=3, value_dtype=dtype_name(result.values.dtype))


def _through_wire(result: SparseResult) -> SparseResult:
    wire = encode_sparse_result(result).SerializeToString()
    return decode_sparse_result(pb.SparseResult.FromString(wire), _layout(result))


@pytest.mark.parametrize("result", [DENSE, TOPK, DCT], ids=["dense", "topk", "dct"])
def test_round_trip_field_by_field(result: SparseResult) -> None:
    _assert_same(_through_wire(result), result)


def test_ids_and_positions_travel_narrow_and_arrive_as_int64() -> None:
    message = encode_sparse_result(DCT)  # 4 × 3 grid of 4 × 4 chunks: both bounds fit int8
    assert (message.chunks.dtype, message.indices.dtype, message.values.dtype) == (
        "int8", "int8", "bfloat16")
    sent = sum(len(t.data) for t in (message.chunks, message.indices, message.values))
    assert sent == payload_bytes(DCT)
    decoded = decode_sparse_result(message, _layout(DCT))
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


def _unchecked(bad: SparseResult) -> pb.SparseResult:
    """``bad`` as a faulty sender would write it: no narrowing, no checks."""
    return pb.SparseResult(
        name=bad.name, shape=bad.shape, encoding=bad.encoding, chunk=bad.chunk,
        region=[pb.Range(start=a, stop=b) for a, b in bad.region], tokens=bad.tokens,
        chunks=encode_tensor(bad.chunks), indices=encode_tensor(bad.indices),
        values=encode_tensor(bad.values),
    )


# Each declares what the run does not take for TOPK's parameter: refused before decoding.
OFF_LAYOUT = {
    "unknown encoding": dict(encoding="zip"),
    "region past shape": dict(region=((0, 20), (0, 12))),
    "region off the grid": dict(region=((2, 8), (0, 12))),
    "integer values": dict(values=TOPK.values.long()),
    "values shape": dict(values=TOPK.values[:, :2]),
    "flat indices": dict(indices=TOPK.indices.flatten()),
    "more per chunk than topk": dict(indices=torch.arange(4).repeat(6, 1),
                                     values=torch.ones(6, 4)),
    "more chunks than the region": dict(chunks=torch.arange(7), indices=torch.zeros(7, 3),
                                        values=torch.ones(7, 3)),
}
# Each is refused by modeling.compression.validate, run on every decoded result.
INCONSISTENT = {
    "no tokens": dict(tokens=0),
    "NaN": dict(values=torch.full_like(TOPK.values, float("nan"))),
    "infinity": dict(values=torch.full_like(TOPK.values, float("inf"))),
    "chunk id past grid": dict(chunks=TOPK.chunks + 100),
    "repeated chunk id": dict(chunks=torch.zeros_like(TOPK.chunks)),
    "chunk outside region": dict(chunks=TOPK.chunks + 6),  # rows [8, 16): tier 0 only
    "position past chunk": dict(indices=TOPK.indices + 16),
    "repeated position": dict(indices=torch.zeros_like(TOPK.indices)),
}


@pytest.mark.parametrize("changes", OFF_LAYOUT.values(), ids=OFF_LAYOUT.keys())
def test_results_off_the_run_layout_are_refused(changes: dict) -> None:
    with pytest.raises(LayoutMismatch, match=f"result '{UP}'"):
        decode_sparse_result(_unchecked(dataclasses.replace(TOPK, **changes)), _layout(TOPK))


@pytest.mark.parametrize("changes", INCONSISTENT.values(), ids=INCONSISTENT.keys())
def test_inconsistent_results_are_refused(changes: dict) -> None:
    wire = _unchecked(dataclasses.replace(TOPK, **changes))
    with pytest.raises(MalformedSparseResult, match=f"result '{UP}' is inconsistent: "):
        decode_sparse_result(wire, _layout(TOPK))


@pytest.mark.parametrize("changes", INCONSISTENT.values(), ids=INCONSISTENT.keys())
def test_a_batch_checked_together_names_its_one_inconsistent_result(changes: dict) -> None:
    """Results decoded together are checked in a few reads over all of them; when one is
    bad, it is found and named as alone."""
    good = [dataclasses.replace(TOPK, name=f"p{i}") for i in range(3)]
    bad = dataclasses.replace(TOPK, **changes)
    messages = [encode_sparse_result(good[0]), _unchecked(bad), encode_sparse_result(good[1])]
    with pytest.raises(MalformedSparseResult, match=f"result '{UP}' is inconsistent: "):
        decode_sparse_results(messages, [_layout(TOPK)] * 3)
    decoded = decode_sparse_results([encode_sparse_result(r) for r in good],
                                    [_layout(TOPK)] * 3)
    for got, sent in zip(decoded, good, strict=True):
        _assert_same(got, sent)


def test_positions_in_any_order_are_taken_and_ascending_ones_are_what_members_send() -> None:
    assert bool((TOPK.indices[:, 1:] > TOPK.indices[:, :-1]).all())  # as encoded
    reversed_rows = dataclasses.replace(TOPK, indices=TOPK.indices.flip(1),
                                        values=TOPK.values.flip(1))
    got = decode_sparse_result(_unchecked(reversed_rows), _layout(TOPK))
    assert torch.equal(got.indices, reversed_rows.indices)


def test_wire_level_faults_are_refused() -> None:
    message = encode_sparse_result(TOPK)
    message.ClearField("values")
    with pytest.raises(MalformedSparseResult, match="no values"):
        decode_sparse_result(message, _layout(TOPK))
    message = encode_sparse_result(TOPK)
    message.chunks.CopyFrom(encode_tensor(TOPK.chunks.float()))
    with pytest.raises(LayoutMismatch, match="chunks are 'float32'"):
        decode_sparse_result(message, _layout(TOPK))
    message = encode_sparse_result(TOPK)
    message.indices.dtype = "int4"
    with pytest.raises(LayoutMismatch, match=r"up_proj\.weight': indices are 'int4'"):
        decode_sparse_result(message, _layout(TOPK))


def _header() -> pb.SubmitHeader:
    return pb.SubmitHeader(round=3, client_id="c1", tokens=512, loss=2.5, train_seconds=1.5)


def test_submission_round_trip() -> None:
    other = dataclasses.replace(DENSE, name="model.norm.weight", shape=(12,), region=((0, 12),),
                                values=torch.randn(12))
    header, rest = read_submission(submission_messages(_header(), [DCT, other]))
    assert header == _header()
    received = list(read_results(rest, {UP: _layout(DCT), other.name: _layout(other)}))
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
        list(read_results(read_submission(messages)[1], {UP: _layout(TOPK)}))


def _dense(name: str, rows: int) -> SparseResult:
    shape = (rows, 512)
    return SparseResult(name=name, shape=shape, region=((0, rows), (0, 512)),
                        encoding="dense", chunk=(), chunks=torch.zeros(0, dtype=torch.int64),
                        indices=torch.zeros(0, 0, dtype=torch.int64),
                        values=torch.randn(shape), tokens=512)


def test_results_travel_in_batches_of_about_batch_bytes() -> None:
    """A batch closes once it holds BATCH_BYTES (a result larger than that closes one
    alone); the batches read as one result per message did."""
    results = [_dense("a", 2), _dense("b", 2), _dense("big", 600), _dense("c", 2),
               _dense("big2", 600), _dense("d", 2)]  # big: 1.2 MB of float32
    assert BATCH_BYTES < 600 * 512 * 4
    layouts = {r.name: _layout(r) for r in results}
    messages = list(submission_messages(_header(), results))
    assert [[r.name for r in m.results.results] for m in messages[1:]] == [
        ["a", "b", "big"], ["c", "big2"], ["d"]]
    single = [messages[0], *(pb.SubmitMessage(result=encode_sparse_result(r)) for r in results)]
    for stream in (messages, single):
        received = list(read_results(read_submission(
            [pb.SubmitMessage.FromString(m.SerializeToString()) for m in stream])[1], layouts))
        for got, sent in zip(received, results, strict=True):
            _assert_same(got, sent)


def test_a_batch_is_refused_whole_before_any_result_in_it_is_decoded() -> None:
    results = [dataclasses.replace(DENSE, name=f"p{i}") for i in range(3)]
    layouts = {f"p{i}": _layout(DENSE) for i in range(3)}
    batch = pb.ResultBatch(results=[encode_sparse_result(r) for r in results])
    header = pb.SubmitMessage(header=_header())
    wrong = pb.ResultBatch()
    wrong.CopyFrom(batch)
    wrong.results.append(pb.SparseResult(name="p9"))  # unknown: refused by name
    with pytest.raises(LayoutMismatch, match="'p9' is not a parameter"):
        next(read_results(read_submission([header, pb.SubmitMessage(results=wrong)])[1],
                          layouts))
    again = pb.ResultBatch(results=[encode_sparse_result(results[0])])  # p0 in two batches
    stream = read_results(read_submission([
        header, *(pb.SubmitMessage(results=b) for b in (batch, again))])[1], layouts)
    assert [r.name for r in itertools.islice(stream, 3)] == ["p0", "p1", "p2"]
    with pytest.raises(MalformedStream, match="'p0' is submitted twice"):
        next(stream)


def test_a_submission_holds_one_result_per_parameter_of_the_run() -> None:
    """A result for a parameter the run does not have is refused before it is decoded."""
    results = [dataclasses.replace(DENSE, name=f"p{i}") for i in range(3)]
    empty = pb.SubmitMessage(result=pb.SparseResult(name="p3"))
    messages = [*submission_messages(_header(), results), empty]
    stream = read_results(read_submission(messages)[1],
                          {f"p{i}": _layout(DENSE) for i in range(3)})
    assert [r.name for r in itertools.islice(stream, 3)] == ["p0", "p1", "p2"]
    with pytest.raises(LayoutMismatch, match="'p3' is not a parameter"):
        next(stream)  # an empty message: decoding it would raise MalformedSparseResult


