"""The ``SubmitResult`` stream: one ``SubmitHeader``, then one ``SparseResult`` per parameter,
each in its own message.

    header, rest = read_submission(messages)   # check round, client and assignment first
    results = list(read_results(rest, result_layouts(compressor, shapes, regions)))
    partials = list(read_partials(rest, partial_layouts(compressor, shapes, tier_regions)))
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

from matformer.modeling.compression.grid import Region
from matformer.modeling.compression.sparse import SparseResult
from matformer.protocol.errors import LayoutMismatch, MalformedStream
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.sparse import ResultLayout, decode_sparse_result, encode_sparse_result


def submission_messages(header: pb.SubmitHeader,
                        results: Iterable[SparseResult]) -> Iterator[pb.SubmitMessage]:
    """The client's request stream; results are encoded one at a time as gRPC sends them."""
    yield pb.SubmitMessage(header=header)
    for result in results:
        yield pb.SubmitMessage(result=encode_sparse_result(result))


def read_submission(messages: Iterable[pb.SubmitMessage]
                    ) -> tuple[pb.SubmitHeader, Iterator[pb.SubmitMessage]]:
    """The header, read at once (so the coordinator can check round, client and assignment
    before any result is read), and the messages after it, unread. Raises
    ``MalformedStream`` when the stream does not start with its header."""
    stream = iter(messages)
    first = next(stream, None)
    if first is None or first.WhichOneof("item") != "header":
        raise MalformedStream("a SubmitResult stream must start with its SubmitHeader.")
    return first.header, stream


def read_results(messages: Iterator[pb.SubmitMessage],
                 layouts: Mapping[str, ResultLayout]) -> Iterator[SparseResult]:
    """The results after the header, decoded lazily, each only once its parameter is one of
    ``layouts`` not sent before and the message has that layout; so a stream holds at most one
    result per parameter, none bigger than an honest one. Raises ``MalformedStream`` for a
    second header or a parameter sent twice, ``ProtocolError`` for a bad result."""
    seen: set[str] = set()
    for message in messages:
        if message.WhichOneof("item") != "result":
            raise MalformedStream("a SubmitResult stream has one SubmitHeader, first.")
        name = message.result.name
        if name not in layouts:
            raise LayoutMismatch(f"{name[:200]!r} is not a parameter of this run's model; "
                                 "send canonical names (modeling.naming).")
        if name in seen:
            raise MalformedStream(f"parameter {name!r} is submitted twice; send each once.")
        seen.add(name)
        yield decode_sparse_result(message.result, layouts[name])


def read_partials(messages: Iterator[pb.SubmitMessage],
                  layouts: Mapping[tuple[str, Region], ResultLayout]) -> Iterator[SparseResult]:
    """A relay's results after the header (``protocol.sparse.partial_layouts``): each decoded
    once its (parameter, region) is one of ``layouts`` not sent before, as ``read_results``
    decodes a member's."""
    seen: set[tuple[str, Region]] = set()
    for message in messages:
        if message.WhichOneof("item") != "result":
            raise MalformedStream("a SubmitResult stream has one SubmitHeader, first.")
        key = (message.result.name, tuple((r.start, r.stop) for r in message.result.region))
        if key not in layouts:
            raise LayoutMismatch(f"{key[0][:200]!r} region {list(key[1])[:8]} is no tier's "
                                 "region of a parameter of this run's model; a relay sends "
                                 "one partial per parameter and tier region.")
        if key in seen:
            raise MalformedStream(f"parameter {key[0]!r} region {list(key[1])} is submitted "
                                  "twice; a relay sends one partial per tier region.")
        seen.add(key)
        yield decode_sparse_result(message.result, layouts[key])
