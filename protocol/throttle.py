"""A slow link on one machine: a channel whose uploads and downloads each move at most a given
number of bits per second (local-testnet's ``--bandwidth-mbit``, beside ``--latency-ms``).

Every message a call sends waits for its size in the upload bucket before it leaves; every
message it receives waits for its size in the download bucket before the caller gets it,
and while the caller waits gRPC's flow control stops the sender, as a narrow link would.
Sizes are the messages' serialized bytes (before gRPC's own compression, so a gzip'd stream
moves as if it were not). The buckets hold one message at most: over a transfer of many
messages the rate is the limit, not a burst above it.

    channel = throttled(grpc.insecure_channel(address), mbit_per_s=20)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
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


def throttled(channel: grpc.Channel, *, mbit_per_s: float) -> grpc.Channel:
    """``channel`` with its uploads and downloads limited to ``mbit_per_s`` each."""
    rate = mbit_per_s * 1e6 / 8
    return grpc.intercept_channel(channel, _Throttle(up=Bucket(rate), down=Bucket(rate)))


def _size(message: Any) -> int:
    return message.ByteSize()


class _Throttle(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, *, up: Bucket, down: Bucket) -> None:
        self.up, self.down = up, down

    def _sent(self, requests: Iterator[Any]) -> Iterator[Any]:
        for request in requests:
            self.up.take(_size(request))
            yield request

    def _received(self, call: Any) -> Any:
        return _ThrottledStream(call, self.down)

    def _answered(self, outcome: Any) -> Any:
        with contextlib.suppress(grpc.RpcError):  # a failed call carries a status, no message
            self.down.take(_size(outcome.result()))
        return outcome

    def intercept_unary_unary(self, continuation, details, request):
        self.up.take(_size(request))
        return self._answered(continuation(details, request))

    def intercept_unary_stream(self, continuation, details, request):
        self.up.take(_size(request))
        return self._received(continuation(details, request))

    def intercept_stream_unary(self, continuation, details, requests):
        return self._answered(continuation(details, self._sent(requests)))

    def intercept_stream_stream(self, continuation, details, requests):
        return self._received(continuation(details, self._sent(requests)))


class _ThrottledStream:
    """A response stream whose messages reach the caller at the download rate; everything
    else (``code()``, ``cancel()``, ...) is the call's own."""

    def __init__(self, call: Any, bucket: Bucket) -> None:
        self._call, self._bucket = call, bucket

    def __iter__(self) -> _ThrottledStream:
        return self

    def __next__(self) -> Any:
        message = next(self._call)
        self._bucket.take(_size(message))
        return message

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)
