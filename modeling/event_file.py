"""TensorBoard event files, written without TensorBoard: scalars are all a run logs, and
their encoding is small enough to own, so no member or coordinator installs TensorBoard (or
TensorFlow's protos) to record them; ``tensorboard --logdir`` reads the files as its own.

    events = EventFile(Path("runs/x/tensorboard"))
    events.add_scalars(step=10, scalars={"loss/tier_0": 3.1})
    events.flush(); events.close()

The file is a sequence of records, each ``length (uint64 LE) · masked CRC-32C of the length
(uint32 LE) · data · masked CRC-32C of the data``; the first record's data is an ``Event``
with ``file_version = "brain.Event:2"``, the rest ``Event{wall_time, step, summary}`` whose
``Summary`` holds one ``Value{tag, simple_value}`` per scalar (tensorflow/core/util/
event.proto and framework/summary.proto; the field numbers below).
"""

from __future__ import annotations

import math
import os
import socket
import struct
import time
from pathlib import Path

FILE_VERSION = b"brain.Event:2"
FLUSH_EVERY_S = 5.0  # scalars reach the file at least this often while a run logs
_MASK_DELTA = 0xA282EAD8
FLOAT32_MAX = 3.4028234663852886e38


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # Castagnoli, reflected
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def record(data: bytes) -> bytes:
    """One record of the file: the framing around ``data``."""
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", masked_crc32c(length)) + data
            + struct.pack("<I", masked_crc32c(data)))


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _float32(value: float) -> float:
    """``value`` as float32 holds it: beyond float32's range, an infinity of its sign."""
    return value if abs(value) <= FLOAT32_MAX or math.isnan(value) else math.copysign(
        math.inf, value)


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def scalar_event(wall_time: float, step: int, scalars: dict[str, float]) -> bytes:
    """``Event{wall_time: 1, step: 2, summary: 5}``; ``Summary{value: 1}``;
    ``Value{tag: 1, simple_value: 2 (float)}``."""
    if step < 0:
        raise ValueError(f"an event's step is at least 0, got {step}")
    summary = b"".join(
        _field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", _float32(value)))
        for tag, value in scalars.items())
    return (b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step)
            + _field(5, summary))


def version_event(wall_time: float) -> bytes:
    """``Event{wall_time: 1, file_version: 3}``: the first record of every file."""
    return b"\x09" + struct.pack("<d", wall_time) + _field(3, FILE_VERSION)


class EventFile:
    """A new event file in ``directory`` (made if absent), named as TensorBoard names its
    own, so that several writers (a resumed run, another process) never share one."""

    _made = 0  # files this process made, the name's last part

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        EventFile._made += 1
        now = time.time()
        self.path = directory / (f"events.out.tfevents.{int(now):010d}."
                                 f"{socket.gethostname()}.{os.getpid()}.{EventFile._made}")
        self._file = self.path.open("xb")
        self._file.write(record(version_event(now)))
        self._flushed = time.monotonic()
        self.flush()

    def add_scalars(self, step: int, scalars: dict[str, float]) -> None:
        """One event at ``step`` holding every scalar (a NaN or infinite one too:
        TensorBoard shows it as such)."""
        values = {tag: float(v) for tag, v in scalars.items()}
        if not values:
            return
        self._file.write(record(scalar_event(time.time(), step, values)))
        if time.monotonic() - self._flushed >= FLUSH_EVERY_S:
            self.flush()

    def flush(self) -> None:
        self._file.flush()
        self._flushed = time.monotonic()

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()

