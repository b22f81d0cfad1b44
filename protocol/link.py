"""A client's link to the coordinator: every message counted each way (``Meter``) and, for a
slow link on one machine (local-testnet's ``--bandwidth-mbit``, beside ``--latency-ms``),
uploads and downloads each held to a given number of bits per second.

Every message a call sends waits for its size in the upload bucket before it leaves; every
message it receives waits for its size in the download bucket before the caller gets it,
and while the caller waits gRPC's flow control stops the sender, as a narrow link would.
Sizes are the messages' serialized bytes (before gRPC's own compression, so a gzip'd stream
moves as if it were not). The buckets hold one message at most: over a transfer of many
messages the rate is the limit, not a burst above it.

    channel, meter = metered(grpc.insecure_channel(address), mbit_per_s=20)  # 0: no limit
    meter.bytes_up, meter.bytes_down
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc


class Bucket:
    """Bytes at ``rate`` per second: ``take(n)`` returns once the link would have carried
    ``n`` more bytes (calls from several threads share the link, in turn)."""

    def __init__(self, bytes_per_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate = bytes_per_s
        self._clock, self._sleep = clock, sleep
        self._free_at = 0.0  # when the link has carried everything taken so far
        self._lock = threading.Lock()
        self.carried = 0  # bytes taken, for the record

    def take(self, size: int) -> None:
        with self._lock:
            now = self._clock()
            self._free_at = max(self._free_at, now) + size / self.rate
            wait = self._free_at - now
            self.carried += size
        if wait > 0:
            self._sleep(wait)


@dataclass
class Meter:
    """Serialized bytes of every message a channel sent and received (before gRPC's
    compression)."""

    bytes_up: int = 0
    bytes_down: int = 0


def metered(channel: grpc.Channel, *, mbit_per_s: float = 0.0) -> tuple[grpc.Channel, Meter]:
    """``channel`` counting its messages, with its uploads and downloads limited to
    ``mbit_per_s`` each (0: no limit)."""
    rate = mbit_per_s * 1e6 / 8
    link = _Link(meter=Meter(), up=Bucket(rate) if rate else None,
                 down=Bucket(rate) if rate else None)
    return grpc.intercept_channel(channel, link), link.meter


def _size(message: Any) -> int:
    return message.ByteSize()


class _Link(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
            grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, *, meter: Meter, up: Bucket | None, down: Bucket | None) -> None:
        self.meter, self.up, self.down = meter, up, down

    def send(self, message: Any) -> None:
        size = _size(message)
        self.meter.bytes_up += size
        if self.up is not None:
            self.up.take(size)

    def receive(self, message: Any) -> None:
        size = _size(message)
        self.meter.bytes_down += size
        if self.down is not None:
            self.down.take(size)

    def _sent(self, requests: Iterator[Any]) -> Iterator[Any]:
        for request in requests:
            self.send(request)
            yield request

    def _answered(self, outcome: Any) -> Any:
        with contextlib.suppress(grpc.RpcError):  # a failed call carries a status, no message
            self.receive(outcome.result())
        return outcome

    def intercept_unary_unary(self, continuation, details, request):
        self.send(request)
        return self._answered(continuation(details, request))

    def intercept_unary_stream(self, continuation, details, request):
        self.send(request)
        return _ReceivedStream(continuation(details, request), self)

    def intercept_stream_unary(self, continuation, details, requests):
        return self._answered(continuation(details, self._sent(requests)))

    def intercept_stream_stream(self, continuation, details, requests):
        return _ReceivedStream(continuation(details, self._sent(requests)), self)


class _ReceivedStream:
    """A response stream whose messages are counted (and held to the download rate) as the
    caller takes them; everything else (``code()``, ``cancel()``, ...) is the call's own."""

    def __init__(self, call: Any, link: _Link) -> None:
        self._call, self._link = call, link

    def __iter__(self) -> _ReceivedStream:
        return self

    def __next__(self) -> Any:
        message = next(self._call)
        self._link.receive(message)
        return message

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)
