"""The ``SubmitResult`` stream: one ``SubmitHeader``, then one ``SparseResult`` per parameter
(or per region of one), each in its own message."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from modeling.compression.sparse import SparseResult
from protocol.errors import MalformedStream, TooManyResults
from protocol.matformer.v1 import coordinator_pb2 as pb
from protocol.sparse import decode_sparse_result, encode_sparse_result


def submission_messages(header: pb.SubmitHeader,
                        results: Iterable[SparseResult]) -> Iterator[pb.SubmitMessage]:
    """The client's request stream; results are encoded one at a time as gRPC sends them."""
    yield pb.SubmitMessage(header=header)
    for result in results:
        yield pb.SubmitMessage(result=encode_sparse_result(result))


def read_submission(
    messages: Iterable[pb.SubmitMessage], *, max_results: int,
) -> tuple[pb.SubmitHeader, Iterator[SparseResult]]:
    """The header (read at once, so the coordinator can check round, client and assignment
    before any result is read) and the checked results, decoded lazily. Raises
    ``MalformedStream`` for a missing or repeated header or a (name, region) sent twice,
    ``TooManyResults`` at result ``max_results + 1`` (the model's parameter count: one result
    per parameter), ``ProtocolError`` for a bad result."""
    stream = iter(messages)
    first = next(stream, None)
    if first is None or first.WhichOneof("item") != "header":
        raise MalformedStream("a SubmitResult stream must start with its SubmitHeader.")
    return first.header, _results(stream, max_results)


def _results(stream: Iterator[pb.SubmitMessage], max_results: int) -> Iterator[SparseResult]:
    seen: set[tuple[str, tuple[tuple[int, int], ...]]] = set()
    for message in stream:
        if message.WhichOneof("item") != "result":
            raise MalformedStream("a SubmitResult stream has one SubmitHeader, first.")
        if len(seen) == max_results:
            raise TooManyResults(f"the submission holds more than {max_results} results, one "
                                 "per parameter of the run's model; send each parameter once.")
        result = decode_sparse_result(message.result)
        if (result.name, result.region) in seen:
            raise MalformedStream(
                f"parameter {result.name!r} region {list(result.region)} is submitted twice."
            )
        seen.add((result.name, result.region))
        yield result
