"""How much of the gRPC server's worker threads one member's calls may hold (issue 15).

Every call runs on one thread of a fixed pool for as long as it lasts, from the moment its
headers arrive: a call whose request never comes holds its thread as surely as a stalled
stream. So ``RequestGate`` hands every handler that takes one request its request through a
watched wait: a member's calls may wait for their request ``per_member`` at once
(``TooManyCalls`` beyond), calls without a session (Join) ``anonymous`` at once
(``NoRequestSlot`` beyond), and a wait longer than ``request_s`` ends the call.

Then a member holds at most ``per_member`` calls at once, ``streams_per_member`` of them
streams (``TooManyCalls`` beyond); the streams of all members together hold at most
``streams`` threads (``NoStreamSlot`` beyond), and the pool has as many again, which only
unary calls (heartbeats above all) can fill. A stream that waits on its peer for ``idle_s``
at once (for the next message, or for the peer to take the last one), or still waits past
the end its handler set (a submission: the round's deadline), is ended from the watchdog
thread; time the server spends on its own work never counts.

    slots = CallSlots(CallLimits())
    with slots.call(client_id):                       # a unary call
        ...
    with slots.stream(client_id, end=cancel) as watch:  # cancel(error) ends the call
        for message in watch.received(request_iterator): ...
        yield from watch.sent(replies)
    grpc.server(pool, interceptors=[RequestGate(slots, identify)])  # identify(session) -> id
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from protocol.auth import SESSION_METADATA_KEY
from server.errors import CallRefused, NoRequestSlot, NoStreamSlot, StreamIdle, TooManyCalls

T = TypeVar("T")


@dataclass(frozen=True, kw_only=True, slots=True)
class CallLimits:
    per_member: int = 4  # calls of one member at once; an honest client makes 2 (a heartbeat
    # beside its main call)
    streams_per_member: int = 2  # of those, streams (an honest client: one at a time)
    streams: int = 16  # streams of all members together
    # the longest a stream may wait on its peer at once: a home link must still take one
    # parameter's update of a large model (24 MiB of signs at 150M parameters) within it
    idle_s: float = 120.0
    anonymous: int = 4  # calls without a session (Join) waiting for their request at once
    request_s: float = 10.0  # the longest a call may wait for its (one, small) request

    @property
    def workers(self) -> int:
        """gRPC worker threads: one per stream slot, and as many again that streams never
        take, so that heartbeats, GetRound and Join are served while every stream stalls."""
        return 2 * self.streams


class CallSlots:
    def __init__(self, limits: CallLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._calls: Counter[str] = Counter()  # client id → its calls in progress
        self._streams: Counter[str] = Counter()  # client id → its streams in progress
        self._awaiting: Counter[str] = Counter()  # client id ("": none) → calls awaiting a request
        self._watches: set[Watch] = set()
        self._watchdog: threading.Thread | None = None

    @contextmanager
    def call(self, client_id: str) -> Iterator[None]:
        """One of ``client_id``'s call slots, held while the ``with`` block runs."""
        self._take(client_id, stream=False)
        try:
            yield
        finally:
            self._give_back(client_id, stream=False)

    @contextmanager
    def stream(self, client_id: str, *, end: Callable[[Exception], None]) -> Iterator[Watch]:
        """A call slot and a stream slot of ``client_id``, and the watch on the stream's waits:
        ``end(error)`` (called from the watchdog thread) ends the call when it waits too long."""
        self._take(client_id, stream=True)
        try:
            with self._watching(Watch(end=end, idle_s=self.limits.idle_s)) as watch:
                yield watch
        finally:
            self._give_back(client_id, stream=True)

    def first_request(self, requests: Iterator[T], client_id: str | None, *,
                      end: Callable[[Exception], None]) -> T | None:
        """The call's one request message (None if the peer sent none), waited for in one of
        ``client_id``'s request slots (None: a call without a session, in an anonymous one);
        TooManyCalls when they are all taken, ``end(StreamIdle)`` after ``request_s``."""
        key = client_id or ""
        limit = self.limits.per_member if client_id else self.limits.anonymous
        with self._lock:
            if self._awaiting[key] >= limit and client_id:
                raise TooManyCalls(f"{client_id} already has {limit} calls waiting for their "
                                   "request, the most one member may; send each request whole.")
            if self._awaiting[key] >= limit:
                raise NoRequestSlot(f"{limit} calls without a session already wait for their "
                                    "request, the most the server takes; retry in a few seconds.")
            self._awaiting[key] += 1
        try:
            with self._watching(Watch(end=end, idle_s=self.limits.request_s)) as watch:
                return next(watch.received(requests), None)
        finally:
            with self._lock:
                self._awaiting[key] -= 1
                if not self._awaiting[key]:
                    del self._awaiting[key]

    @contextmanager
    def _watching(self, watch: Watch) -> Iterator[Watch]:
        """``watch`` checked by the watchdog thread (started with the first) while the block
        runs."""
        with self._lock:
            self._watches.add(watch)
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                                  name="matformer-stream-watch")
                self._watchdog.start()
        try:
            yield watch
        finally:
            with self._lock:
                self._watches.discard(watch)

    def _take(self, client_id: str, *, stream: bool) -> None:
        limits = self.limits
        with self._lock:
            if self._calls[client_id] >= limits.per_member:
                raise TooManyCalls(
                    f"{client_id} already has {limits.per_member} calls in progress, the most "
                    "one member may hold at once; wait for one to end before starting another.")
            if stream and self._streams[client_id] >= limits.streams_per_member:
                raise TooManyCalls(
                    f"{client_id} already has {limits.streams_per_member} streams in progress, "
                    "the most one member may hold at once; finish one before opening another.")
            if stream and self._streams.total() >= limits.streams:
                raise NoStreamSlot(f"all {limits.streams} stream slots of the server are in "
                                   "use; retry in a few seconds.")
            self._calls[client_id] += 1
            if stream:
                self._streams[client_id] += 1

    def _give_back(self, client_id: str, *, stream: bool) -> None:
        with self._lock:
            for counts in (self._calls, self._streams) if stream else (self._calls,):
                counts[client_id] -= 1
                if not counts[client_id]:  # or every member ever seen would stay
                    del counts[client_id]

    def _watch(self) -> None:
        """The watchdog: runs while any stream is open, ends those that wait too long."""
        tick = min(1.0, self.limits.idle_s / 4, self.limits.request_s / 4)
        while True:
            with self._lock:
                if not self._watches:
                    self._watchdog = None
                    return
                now = time.monotonic()
                for watch in self._watches:
                    watch.check(now)
            time.sleep(tick)


class Watch:
    """One stream's waits on its peer. The handler's thread marks each wait through
    ``received`` or ``sent``; the watchdog thread ends the call in the middle of one that has
    lasted ``idle_s``, or that is still going on after the end set by ``until``."""

    def __init__(self, *, end: Callable[[Exception], None], idle_s: float) -> None:
        self._end = end
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._waiting_since: float | None = None  # time.monotonic() of the wait in progress
        self._until: tuple[float, Exception] | None = None
        self._ended: Exception | None = None  # why the watchdog ended the call

    def received(self, messages: Iterator[T]) -> Iterator[T]:
        """A client stream's messages, each wait for the next one watched."""
        while True:
            self._wait()
            try:
                message = next(messages)
            except StopIteration:
                return
            finally:
                self._waited()
            yield message

    def sent(self, messages: Iterable[T]) -> Iterator[T]:
        """A server stream's messages, each wait for the peer to take one watched (gRPC
        resumes the handler's generator once the message it yielded has been sent)."""
        for message in messages:
            self._wait()
            yield message
            self._waited()

    def until(self, deadline: float, error: Exception) -> None:
        """End the call with ``error`` if it waits on its peer after ``deadline``
        (``time.monotonic()``)."""
        with self._lock:
            self._until = (deadline, error)

    def check(self, now: float) -> None:
        """(watchdog) End the call if the wait in progress has lasted too long."""
        with self._lock:
            if self._waiting_since is None or self._ended is not None:
                return
            if now - self._waiting_since >= self._idle_s:
                self._ended = StreamIdle(
                    f"the stream waited {self._idle_s:g} s for its peer to send or take a "
                    "message, the longest a stream may hold a server thread; it was ended. "
                    "Send and read without pausing.")
            elif self._until is not None and now >= self._until[0]:
                self._ended = self._until[1]
            else:
                return
            self._end(self._ended)

    def _wait(self) -> None:
        with self._lock:
            self._waiting_since = time.monotonic()

    def _waited(self) -> None:
        """The wait is over; raises the watchdog's error if it ended the call meanwhile (the
        peer hears it already: the handler must not go on)."""
        with self._lock:
            self._waiting_since = None
            if self._ended is not None:
                raise self._ended


class RequestGate(grpc.ServerInterceptor):
    """Serves every method that takes one request as one that takes a stream of them, so that
    its worker thread waits for the request in ``CallSlots.first_request`` (bounded in number
    and time) instead of inside gRPC, where nothing can count or end the wait. ``identify``
    maps a presented session token to its client id (None if unknown)."""

    def __init__(self, slots: CallSlots, identify: Callable[[str], str | None]) -> None:
        self.slots = slots
        self.identify = identify

    def intercept_service(self, continuation: Callable[..., grpc.RpcMethodHandler | None],
                          details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None or handler.request_streaming:
            return handler
        token = dict(details.invocation_metadata).get(SESSION_METADATA_KEY)
        client_id = self.identify(token) if token else None
        behaviour = handler.unary_stream if handler.response_streaming else handler.unary_unary

        def gated(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            try:
                request = self.slots.first_request(requests, client_id,
                                                   end=lambda err: end_call(context, err))
            except CallRefused as err:
                context.abort(err.code, str(err))
            if request is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request.")
            return behaviour(request, context)

        wrap = (grpc.stream_stream_rpc_method_handler if handler.response_streaming
                else grpc.stream_unary_rpc_method_handler)
        return wrap(gated, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


def end_call(context: grpc.ServicerContext, err: Exception) -> None:
    """End a call from outside its handler's thread (the handler waits on its peer) with
    ``err``'s status (its ``code``) and message. gRPC's public ``context.cancel()`` answers
    CANCELLED without a reason, so this cancels the call under the context, with the status,
    instead (grpcio's internals, checked by tests/test_server_bounds.py; another grpcio ends
    it without one)."""
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    if call is None:
        context.cancel()
        return
    call.cancel(err.code.value[0], str(err))
