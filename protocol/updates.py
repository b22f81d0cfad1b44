"""The ``GetUpdates`` stream: per round, one ``RoundUpdateHeader`` then as many
``ParameterUpdate`` messages as it announces, one per updated parameter.

A parameter's update is a ``modeling.compression.Aggregate`` (values and covering tokens over
the universal shape). It travels as a dense ``SparseResult`` over the smallest region holding
every covered element, plus the tokens there as coverage, and is rebuilt exactly; a sparse
encoding is decoded with ``modeling.compression.decode``. The coordinator can keep the same
messages as its update log; a client replays them to catch up.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from modeling.compression import Aggregate, SparseResult, decode, region_shape, region_slices
from protocol.errors import MalformedStream, ProtocolError
from protocol.matformer.v1 import coordinator_pb2 as pb
from protocol.sparse import decode_sparse_result, encode_sparse_result
from protocol.tensors import decode_tensor, encode_tensor


@dataclass(frozen=True, slots=True)
class RoundUpdate:
    round: int
    learning_rate: float  # the rate the update rule used in this round
    weight_hash: str  # of the master weights after this round's update
    parameters: dict[str, Aggregate]  # canonical name → the parameter's aggregate
    # The update rule reads only the sign of the values and which elements are covered
    # (rule "sign"): they travel as int8 signs and a 0/1 coverage, 1 byte per element or less
    # instead of 8, and decode to an aggregate that rule applies identically.
    signs_only: bool = False


def update_messages(updates: Iterable[RoundUpdate]) -> Iterator[pb.UpdateMessage]:
    """The coordinator's response stream, encoded one parameter at a time."""
    for update in updates:
        yield pb.UpdateMessage(header=pb.RoundUpdateHeader(
            round=update.round, learning_rate=update.learning_rate,
            weight_hash=update.weight_hash, parameters=len(update.parameters)))
        for name, aggregate in update.parameters.items():
            yield pb.UpdateMessage(parameter=encode_parameter_update(
                name, aggregate, signs_only=update.signs_only))


def read_updates(messages: Iterable[pb.UpdateMessage]) -> Iterator[RoundUpdate]:
    """Checked round updates, each yielded once its last parameter has arrived. Raises
    ``MalformedStream`` for a parameter outside its round, a round cut short, a parameter
    twice in one round or rounds out of order, ``ProtocolError`` for a bad parameter."""
    header, parameters, last_round = None, {}, None
    for message in messages:
        if message.WhichOneof("item") == "header":
            if header is not None:
                raise _cut_short(header, len(parameters))
            header = message.header
            if last_round is not None and header.round <= last_round:
                raise MalformedStream(f"round {header.round} arrives after round {last_round}.")
        elif header is None:
            raise MalformedStream("a parameter update arrived before its round's header.")
        else:
            name, aggregate = decode_parameter_update(message.parameter)
            if name in parameters:
                raise MalformedStream(f"round {header.round} updates {name!r} twice.")
            parameters[name] = aggregate
        if header is not None and len(parameters) == header.parameters:
            yield RoundUpdate(round=header.round, learning_rate=header.learning_rate,
                              weight_hash=header.weight_hash, parameters=parameters)
            header, parameters, last_round = None, {}, header.round
    if header is not None:
        raise _cut_short(header, len(parameters))


def encode_parameter_update(name: str, aggregate: Aggregate, *, signs_only: bool = False
                            ) -> pb.ParameterUpdate:
    """One parameter's update; ``signs_only``: as int8 signs and a 0/1 coverage (for rules
    that read nothing else). Coverage is left out when it is the same all over the region."""
    region = _covered_box(name, aggregate.covered)
    where = region_slices(region)
    empty = torch.zeros(0, dtype=torch.int64)
    values, coverage = aggregate.values[where], aggregate.tokens[where]
    if signs_only:
        values = values.sign().to(torch.int8)
        coverage = (coverage > 0).to(torch.uint8)
    result = SparseResult(
        name=name, shape=tuple(aggregate.values.shape), region=region, encoding="dense",
        chunk=(), chunks=empty, indices=empty, values=values,
        tokens=round(float(coverage.max())),
    )
    message = pb.ParameterUpdate(aggregate=encode_sparse_result(result))
    if not bool((coverage == coverage.flatten()[0]).all()):
        message.coverage.CopyFrom(encode_tensor(coverage))
    return message


def decode_parameter_update(message: pb.ParameterUpdate) -> tuple[str, Aggregate]:
    """Message → (name, the aggregate over the universal shape); checked throughout."""
    if not message.HasField("aggregate"):
        raise MalformedStream("a parameter update has no aggregate.")
    if message.aggregate.values.dtype == "int8":  # signs_only: checked, then read as floats
        name = message.aggregate.name
        signs = decode_tensor(message.aggregate.values, f"signs of {name!r}")
        if bool((signs.abs() > 1).any()):
            raise MalformedStream(f"the signs of {name!r} are not all -1, 0 or 1.")
        as_floats = pb.ParameterUpdate()
        as_floats.CopyFrom(message)
        as_floats.aggregate.values.CopyFrom(encode_tensor(signs.float()))
        message = as_floats
    result = decode_sparse_result(message.aggregate)
    where = region_slices(result.region)
    values = torch.zeros(result.shape)
    values[where] = decode(result).float()
    tokens = torch.zeros(result.shape)
    if message.HasField("coverage"):
        coverage = decode_tensor(message.coverage, f"coverage of {result.name!r}")
        if tuple(coverage.shape) != region_shape(result.region):
            raise MalformedStream(
                f"coverage of {result.name!r} has shape {list(coverage.shape)}; its region's "
                f"shape is {list(region_shape(result.region))}."
            )
        valid = bool(torch.isfinite(coverage).all()) and not bool((coverage < 0).any())
        if coverage.dtype == torch.bool or not valid:
            raise MalformedStream(f"coverage of {result.name!r} is not finite token counts.")
        tokens[where] = coverage.float()
    else:
        tokens[where] = float(result.tokens)
    return result.name, Aggregate(values=values, tokens=tokens)


def _covered_box(name: str, covered: torch.Tensor) -> tuple[tuple[int, int], ...]:
    """[start, stop) per dimension of the smallest box holding every covered element."""
    if not bool(covered.any()):
        raise ProtocolError(f"the aggregate of {name!r} covers nothing; leave it out.")
    box = []
    for dim, size in enumerate(covered.shape):
        hit = covered.movedim(dim, 0).reshape(size, -1).any(dim=1).nonzero()  # (m, 1) indices
        box.append((int(hit[0]), int(hit[-1]) + 1))
    return tuple(box)


def _cut_short(header: pb.RoundUpdateHeader, received: int) -> MalformedStream:
    return MalformedStream(
        f"round {header.round} announced {header.parameters} parameter updates but the stream "
        f"moved on after {received}."
    )
