"""The ``SubmitResult`` stream: one ``SubmitHeader``, then the parameters' ``SparseResult``s
in batches (``ResultBatch``, about ``BATCH_BYTES`` each; a stream of one result per message,
as members sent before batches, reads the same).

    header, rest = read_submission(messages)   # check round, client and assignment first
    results = list(read_results(rest, result_layouts(compressor, shapes, regions)))
    partials = list(read_partials(rest, partial_layouts(compressor, shapes, tier_regions)))
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping
from typing import TypeVar

from matformer.modeling.compression.grid import Region
from matformer.modeling.compression.sparse import SparseResult
from matformer.protocol.channel import batched
from matformer.protocol.errors import LayoutMismatch, MalformedStream
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.sparse import (
    ResultLayout,
    decode_sparse_results,
    encode_sparse_result,
)

K = TypeVar("K", bound=Hashable)


def submission_messages(header: pb.SubmitHeader,
                        results: Iterable[SparseResult]) -> Iterator[pb.SubmitMessage]:
    """The client's request stream; results are encoded a batch at a time as gRPC sends
    them."""
    yield pb.SubmitMessage(header=header)
    yield from result_batches(encode_sparse_result(result) for result in results)


def result_batches(encoded: Iterable[pb.SparseResult]) -> Iterator[pb.SubmitMessage]:
    """Encoded results as the stream's messages after the header, a batch each."""
    for batch in batched(encoded, lambda message: message.ByteSize()):
        yield pb.SubmitMessage(results=pb.ResultBatch(results=batch))


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
    """The results after the header, decoded a message at a time, each only once its
    parameter is one of ``layouts`` not sent before and it has that layout; so a stream
    holds at most one result per parameter, none bigger than an honest one. Raises
    ``MalformedStream`` for a second header or a parameter sent twice, ``ProtocolError``
    for a bad result."""
    for batch in screen_results(messages, layouts):
        yield from decode_screened([batch])


def read_partials(messages: Iterator[pb.SubmitMessage],
                  layouts: Mapping[tuple[str, Region], ResultLayout]) -> Iterator[SparseResult]:
    """A relay's results after the header (``protocol.sparse.partial_layouts``): each decoded
    once its (parameter, region) is one of ``layouts`` not sent before, as ``read_results``
    decodes a member's."""
    for batch in screen_partials(messages, layouts):
        yield from decode_screened([batch])


Screened = tuple[list[pb.SparseResult], list[ResultLayout]]  # a message's results, layouts


def screen_results(messages: Iterable[pb.SubmitMessage],
                   layouts: Mapping[str, ResultLayout]) -> Iterator[Screened]:
    """Each message's results with their layouts, as ``read_results`` takes them but not
    yet decoded: what a server keeps while an upload arrives, refusing it at the first
    result for a parameter the run lacks or sends twice (so it holds at most one message's
    worth of results per parameter), to decode the whole upload after
    (``decode_screened``)."""

    def key(result: pb.SparseResult) -> str:
        name = result.name
        if name not in layouts:
            raise LayoutMismatch(f"{name[:200]!r} is not a parameter of this run's model; "
                                 "send canonical names (modeling.naming).")
        return name

    return _screen(messages, layouts, key, lambda name: (
        f"parameter {name!r} is submitted twice; send each once."))


def screen_partials(messages: Iterable[pb.SubmitMessage],
                    layouts: Mapping[tuple[str, Region], ResultLayout]) -> Iterator[Screened]:
    """``screen_results`` for a relay's results (``read_partials``)."""

    def key(result: pb.SparseResult) -> tuple[str, Region]:
        found = (result.name, tuple((r.start, r.stop) for r in result.region))
        if found not in layouts:
            raise LayoutMismatch(f"{found[0][:200]!r} region {list(found[1])[:8]} is no "
                                 "tier's region of a parameter of this run's model; a relay "
                                 "sends one partial per parameter and tier region.")
        return found

    return _screen(messages, layouts, key, lambda found: (
        f"parameter {found[0]!r} region {list(found[1])} is submitted twice; a relay sends "
        "one partial per tier region."))


def decode_screened(screened: Iterable[Screened]) -> list[SparseResult]:
    """The screened messages' results, decoded and checked a message at a time
    (``decode_sparse_results``)."""
    return [result for batch, layouts in screened
            for result in decode_sparse_results(batch, layouts)]


def _screen(messages: Iterable[pb.SubmitMessage], layouts: Mapping[K, ResultLayout],
            key: Callable[[pb.SparseResult], K], twice: Callable[[K], str]
            ) -> Iterator[Screened]:
    seen: set[K] = set()
    for message in messages:
        item = message.WhichOneof("item")
        if item == "result":
            batch = [message.result]
        elif item == "results":
            batch = list(message.results.results)
        else:
            raise MalformedStream("a SubmitResult stream has one SubmitHeader, first.")
        found = []
        for result in batch:
            k = key(result)
            if k in seen:
                raise MalformedStream(twice(k))
            seen.add(k)
            found.append(layouts[k])
        yield batch, found
