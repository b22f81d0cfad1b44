"""The ``GetUpdates`` stream: per round, one ``RoundUpdateHeader`` (round, rule, lr, weight
decay, the requesting tier's weight hash) then the ``ParameterUpdate``s it announces, one
``modeling.compression`` step per updated parameter, in batches (``ParameterBatch``, about
``BATCH_BYTES`` each; one per message, as coordinators sent them before, reads the same).

A round travels as the record the coordinator logged (``RoundUpdate``), cut to the tier's
regions (``RoundUpdate.cut``); every field of a step has a message field, so decoding gives
back the same step, checked throughout: a client applies nothing it cannot apply exactly.
Asked with ``headers_only``, the stream carries the headers alone (``read_headers``): the
coordinator's word on each round, which a round taken from a mirror must match.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from matformer.modeling.compression import (
    UPDATE_RULES,
    ChunkGrid,
    CoefficientStep,
    DenseStep,
    Region,
    RoundUpdate,
    Step,
    UpdateConfig,
    bounding_box,
    pack_bits,
    position_bits,
    region_shape,
    unpack_bits,
)
from matformer.modeling.compression.steps import LEVEL_BITS
from matformer.modeling.errors import CompressionError
from matformer.protocol.channel import batched
from matformer.protocol.errors import MalformedStream
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.tensors import decode_tensor, encode_tensor


def update_messages(updates: Iterable[RoundUpdate]) -> Iterator[pb.UpdateMessage]:
    """The coordinator's response stream: per round its header, then its parameters in
    batches of about ``BATCH_BYTES``. Each update is already cut to one tier
    (``RoundUpdate.cut``): its one hash goes in the header."""
    for update in updates:
        weight_hash = next(iter(update.hashes.values())) if len(update.hashes) == 1 else ""
        yield pb.UpdateMessage(header=pb.RoundUpdateHeader(
            round=update.round, learning_rate=update.update.lr, weight_hash=weight_hash,
            parameters=len(update.steps), rule=update.update.rule,
            weight_decay=update.update.weight_decay))
        encoded = (encode_step(name, step) for name, step in update.steps.items())
        for batch in batched(encoded, lambda message: message.ByteSize()):
            yield pb.UpdateMessage(parameters=pb.ParameterBatch(parameters=batch))


def carries_values(messages: Sequence[pb.UpdateMessage]) -> bool:
    """Whether a round's messages carry a dense step, the kind gzip shrinks (the sign
    rule's int8 signs, about five times). A compressed broadcast's levels and packed
    positions shrink by about 4%, for gzip's 50 MB/s on every member's copy: 0.1 s of the
    coordinator's CPU per member and round at 162M, so its rounds travel as they are."""
    for message in messages:
        item = message.WhichOneof("item")
        batch = (message.parameters.parameters if item == "parameters"
                 else [message.parameter] if item == "parameter" else [])
        if any(p.WhichOneof("form") == "values" for p in batch):
            return True
    return False


def read_updates(messages: Iterable[pb.UpdateMessage], tier: int = 0) -> Iterator[RoundUpdate]:
    """Checked round updates for a client of ``tier`` (the tier its header's hash is of),
    each yielded once its last parameter has arrived. Raises ``MalformedStream`` for a
    parameter outside its round, a round cut short, a parameter twice in one round or rounds
    out of order or a bad header or parameter."""
    header, steps, last_round = None, {}, None
    for message in messages:
        if message.WhichOneof("item") == "header":
            if header is not None:
                raise _cut_short(header, len(steps))
            header = message.header
            if last_round is not None and header.round <= last_round:
                raise MalformedStream(f"round {header.round} arrives after round {last_round}.")
        elif header is None:
            raise MalformedStream("a parameter update arrived before its round's header.")
        else:
            batch = (message.parameters.parameters
                     if message.WhichOneof("item") == "parameters" else [message.parameter])
            for parameter in batch:
                name, step = decode_step(parameter)
                if name in steps:
                    raise MalformedStream(f"round {header.round} updates {name!r} twice.")
                steps[name] = step
            if len(steps) > header.parameters:
                raise MalformedStream(f"round {header.round} announces {header.parameters} "
                                      f"parameters but carries {len(steps)}.")
        if header is not None and len(steps) == header.parameters:
            yield RoundUpdate(round=header.round, update=_rule(header), steps=steps,
                              hashes={tier: header.weight_hash} if header.weight_hash else {})
            header, steps, last_round = None, {}, header.round
    if header is not None:
        raise _cut_short(header, len(steps))


@dataclass(frozen=True, slots=True)
class RoundHeader:
    """A round as its header describes it, without its steps."""

    round: int
    update: UpdateConfig  # rule, lr and weight decay
    parameters: int  # parameter updates it carries
    weight_hash: str  # of the requesting tier's weights after it; "": none published

    @classmethod
    def of(cls, update: RoundUpdate, tier: int) -> RoundHeader:
        """What ``update``'s header said, as ``read_updates`` gave it at ``tier``."""
        return cls(round=update.round, update=update.update, parameters=len(update.steps),
                   weight_hash=update.hashes.get(tier, ""))


def read_headers(messages: Iterable[pb.UpdateMessage]) -> Iterator[RoundHeader]:
    """The round headers of a GetUpdates stream (a ``headers_only`` one holds nothing else).
    Raises ``MalformedStream`` for a rule this client does not apply."""
    for message in messages:
        if message.WhichOneof("item") == "header":
            header = message.header
            yield RoundHeader(round=header.round, update=_rule(header),
                              parameters=header.parameters, weight_hash=header.weight_hash)


def encode_step(name: str, step: Step) -> pb.ParameterUpdate:
    message = pb.ParameterUpdate(
        name=name, shape=step.shape, box=_ranges(step.box),
        covered=[pb.Box(range=_ranges(box)) for box in step.covered])
    if isinstance(step, DenseStep):
        message.values.CopyFrom(encode_tensor(step.values))
    else:
        bits = position_bits(step.grid.chunk_numel)
        message.coefficients.CopyFrom(pb.Coefficients(
            chunk=step.chunk, positions=pack_bits(step.positions, bits),
            scales=encode_tensor(step.scales), **_levels(step.levels)))
    return message


def _levels(levels: Tensor) -> dict[str, object]:
    """A step's levels as they travel: packed to the fewest bits of LEVEL_BITS that hold
    them (a broadcast of [update] broadcast_bits 4 or 2), else as int8."""
    most = int(levels.to(torch.int16).abs().max()) if levels.numel() else 0
    bits = min((b for b in LEVEL_BITS if most <= (1 << (b - 1)) - 1), default=8)
    if bits == 8:
        return {"levels": encode_tensor(levels)}
    offset = (1 << (bits - 1)) - 1
    packed = pack_bits(levels.to(torch.int64) + offset, bits)
    return {"levels": encode_tensor(torch.frombuffer(bytearray(packed), dtype=torch.uint8)),
            "level_bits": bits, "per_chunk": levels.shape[1]}


def decode_step(message: pb.ParameterUpdate) -> tuple[str, Step]:
    """Message → (name, step); raises ``MalformedStream`` unless every field is consistent
    (boxes inside the shape, the box bounding them, sizes, dtypes and value ranges)."""
    name, shape = message.name, tuple(message.shape)
    what = f"the update of {name!r}"
    if not shape or any(n < 1 for n in shape):
        raise MalformedStream(f"{what} has shape {list(shape)}; every dimension must be >= 1.")
    covered = tuple(_region(box.range, shape, what) for box in message.covered)
    box = _region(message.box, shape, what)
    if not covered or box != bounding_box(covered):
        raise MalformedStream(f"{what}: its box {box} is not the bounding box of the regions "
                              f"it covers {covered}.")
    form = message.WhichOneof("form")
    if form == "values":
        values = decode_tensor(message.values, f"{what}: values")
        if tuple(values.shape) != region_shape(box):
            raise MalformedStream(f"{what}: values of shape {list(values.shape)} do not fill "
                                  f"its box of shape {list(region_shape(box))}.")
        if values.dtype == torch.int8 and bool((values.abs() > 1).any()):
            raise MalformedStream(f"the signs of {name!r} are not all -1, 0 or 1.")
        if values.dtype not in (torch.int8, torch.float32, torch.float64) or not bool(
                torch.isfinite(values).all()):
            raise MalformedStream(f"{what}: values must be finite float32 (float64 from a "
                                  "float64 dense run) or int8 signs.")
        return name, DenseStep(shape=shape, covered=covered, box=box, values=values)
    if form != "coefficients":
        raise MalformedStream(f"{what} carries neither values nor coefficients.")
    return name, _coefficients(message.coefficients, shape, covered, box, what)


def _coefficients(message: pb.Coefficients, shape: tuple[int, ...], covered: tuple[Region, ...],
                  box: Region, what: str) -> CoefficientStep:
    chunk = tuple(message.chunk)
    if len(chunk) != len(shape) or not all(1 <= c <= n for c, n in zip(chunk, shape,
                                                                        strict=True)):
        raise MalformedStream(f"{what}: chunk {list(chunk)} does not fit shape {list(shape)}.")
    grid = ChunkGrid(shape=shape, chunk=chunk)
    try:
        grid.check_region(box)
    except CompressionError as err:
        raise MalformedStream(f"{what}: {err}") from None
    levels = decode_tensor(message.levels, f"{what}: levels")
    scales = decode_tensor(message.scales, f"{what}: scales")
    rows = len(grid.chunk_ids(box))
    if message.level_bits:
        levels = _unpacked(levels, message.level_bits, rows, message.per_chunk, grid, what)
    if levels.dtype != torch.int8 or levels.ndim != 2 or len(levels) != rows:
        raise MalformedStream(f"{what}: levels must be int8 of shape ({rows}, k), one row per "
                              f"chunk of its box, got {levels.dtype} {list(levels.shape)}.")
    if not 1 <= levels.shape[1] <= grid.chunk_numel or bool((levels == -128).any()):
        raise MalformedStream(f"{what}: levels must number 1..{grid.chunk_numel} per chunk and "
                              "lie in [-127, 127].")
    if scales.dtype != torch.float32 or tuple(scales.shape) != (rows,) or not bool(
            (torch.isfinite(scales) & (scales >= 0)).all()):
        raise MalformedStream(f"{what}: scales must be {rows} finite float32 values >= 0.")
    try:
        positions = unpack_bits(message.positions, position_bits(grid.chunk_numel),
                                levels.numel()).reshape(levels.shape)
    except ValueError as err:
        raise MalformedStream(f"{what}: positions: {err}") from None
    ordered = positions.sort(dim=1).values
    if bool((positions >= grid.chunk_numel).any()) or bool(
            (ordered[:, 1:] == ordered[:, :-1]).any()):
        raise MalformedStream(f"{what}: positions must be distinct within a chunk and below "
                              f"{grid.chunk_numel}.")
    return CoefficientStep(shape=shape, covered=covered, box=box, chunk=chunk,
                           positions=positions, levels=levels, scales=scales)


def _unpacked(packed: Tensor, bits: int, rows: int, per_chunk: int, grid: ChunkGrid,
              what: str) -> Tensor:
    """Levels packed to ``bits`` bits → int8 (rows, per_chunk); MalformedStream for bits
    the broadcast does not use, or bytes that do not hold rows × per_chunk levels."""
    if bits not in LEVEL_BITS[1:] or not 1 <= per_chunk <= grid.chunk_numel:
        raise MalformedStream(f"{what}: levels of {bits} bits, {per_chunk} per chunk; a "
                              f"broadcast packs them to {' or '.join(map(str, LEVEL_BITS[1:]))}"
                              f" bits, 1..{grid.chunk_numel} per chunk.")
    if packed.dtype != torch.uint8 or packed.ndim != 1:
        raise MalformedStream(f"{what}: packed levels must be uint8 bytes, got {packed.dtype} "
                              f"{list(packed.shape)}.")
    try:
        codes = unpack_bits(packed.numpy().tobytes(), bits, rows * per_chunk)
    except ValueError as err:
        raise MalformedStream(f"{what}: levels: {err}") from None
    offset = (1 << (bits - 1)) - 1
    if bool((codes > 2 * offset).any()):
        raise MalformedStream(f"{what}: a {bits}-bit level lies outside [-{offset}, {offset}].")
    return (codes - offset).to(torch.int8).reshape(rows, per_chunk)


def _ranges(region: Region) -> list[pb.Range]:
    return [pb.Range(start=start, stop=stop) for start, stop in region]


def _region(ranges: Iterable[pb.Range], shape: tuple[int, ...], what: str) -> Region:
    region = tuple((r.start, r.stop) for r in ranges)
    if len(region) != len(shape) or not all(
            0 <= start < stop <= n for (start, stop), n in zip(region, shape, strict=True)):
        raise MalformedStream(f"{what}: region {region} is empty or outside shape "
                              f"{list(shape)}.")
    return region


def _rule(header: pb.RoundUpdateHeader) -> UpdateConfig:
    if header.rule not in UPDATE_RULES:
        raise MalformedStream(f"round {header.round} names update rule {header.rule!r}; this "
                              f"client applies {', '.join(UPDATE_RULES)}: upgrade it.")
    try:
        return UpdateConfig(rule=header.rule, lr=header.learning_rate,
                            weight_decay=header.weight_decay)
    except CompressionError as err:
        raise MalformedStream(f"round {header.round}: {err}") from None


def _cut_short(header: pb.RoundUpdateHeader, received: int) -> MalformedStream:
    return MalformedStream(
        f"round {header.round} announced {header.parameters} parameter updates but the stream "
        f"moved on after {received}."
    )
