"""How much of the server one member's calls may hold (issues 15 and 30).

Every call holds a thread of the gRPC pool from the moment its headers arrive, so
``RequestGate`` takes each call's first message (its request, or a submission's header)
through a watched wait of at most ``request_s``, and a member's call holds one of the
member's ``per_member`` call slots from then until it ends (``TooManyCalls`` beyond); calls
without a session (Join) may wait for their request ``anonymous`` at once (``NoRequestSlot``
beyond). The pool has a thread for every call these limits admit (``workers``; Python starts
them as calls need them), so no call waits for a thread: a member's heartbeat is refused
only when that member itself holds all its call slots.

Streams hold more than a thread (the message in flight, a file being read), so they are
counted as well: ``streams_per_member`` per member (``TooManyCalls`` beyond). A member the
open round assigned work to has one stream of its own; every other stream takes one of the
``streams`` shared slots (``NoStreamSlot`` beyond), and a member's second stream only while
half of them are free. So members without work, however many, never hold the stream of a
member with work, and a few members cannot take every shared slot either.

A stream that waits on its peer (for the next message, or for the peer to take the last
one) ``idle_s`` longer than the message needs at ``SLOWEST_LINK_BYTES_S`` (a message sent:
its size; a message awaited: the largest the server takes), or still waits past the end its
handler set (a submission: the round's deadline), is ended from the watchdog thread; time
the server spends on its own work never counts.

    slots = CallSlots(CallLimits(), assigned=has_work)  # has_work(client_id) -> bool
    with slots.stream(client_id, end=cancel) as watch:  # cancel(error) ends the call
        for message in watch.received(request_iterator): ...
        yield from watch.sent(replies)
    grpc.server(pool, interceptors=[RequestGate(slots, identify)])  # identify(session) -> id
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message

from matformer.protocol.auth import SESSION_METADATA_KEY
from matformer.server.errors import (
    CallRefused,
    NoRequestSlot,
    NoStreamSlot,
    StreamIdle,
    TooManyCalls,
)

T = TypeVar("T")
M = TypeVar("M", bound=Message)

# 8 Mbit/s: the slowest link a stream is given time for. A message of 5 MB may take 5 s
# beyond idle_s; a link slower than this could not deliver a large model's results in a round.
SLOWEST_LINK_BYTES_S = 1_000_000


@dataclass(frozen=True, kw_only=True, slots=True)
class CallLimits:
    # calls of one member at once: a synchronous client makes 2 (a heartbeat beside its main
    # call), an overlapped one up to 4 (a heartbeat, an upload, sequences, an update)
    per_member: int = 4
    streams_per_member: int = 3  # of those, streams (an overlapped client's last three)
    streams: int = 16  # shared by every stream but the one of each member with work
    # how long a stream may wait on its peer beyond what the message needs at
    # SLOWEST_LINK_BYTES_S: a home link may stall for a few seconds
    idle_s: float = 10.0
    anonymous: int = 4  # calls without a session (Join) waiting for their request at once
    request_s: float = 10.0  # the longest a call may wait for its first (small) message
    members: int = 512  # members at once ([faults] max_members)
    message_bytes: int = 64 * 2**20  # the largest message the server takes

    @property
    def workers(self) -> int:
        """gRPC worker threads: one for every call the limits admit (each member's, calls
        without a session waiting for their request, and as many again being answered)."""
        return self.members * self.per_member + 2 * self.anonymous


class CallSlots:
    def __init__(self, limits: CallLimits, *,
                 assigned: Callable[[str], bool] = lambda client_id: False) -> None:
        """``assigned(client_id)``: whether the open round assigned that member work."""
        self.limits = limits
        self._assigned = assigned
        self._lock = threading.Lock()
        self._calls: Counter[str] = Counter()  # client id → its calls in progress
        self._streams: Counter[str] = Counter()  # client id → its streams in progress
        self._own: set[str] = set()  # members whose own stream is in use
        self._shared = 0  # shared stream slots in use
        self._anonymous = 0  # calls without a session waiting for their request
        self._watches: set[Watch] = set()
        self._watchdog: threading.Thread | None = None

    @contextmanager
    def call(self, client_id: str) -> Iterator[None]:
        """One of ``client_id``'s call slots, held while the ``with`` block runs."""
        with self._lock:
            if self._calls[client_id] >= self.limits.per_member:
                raise TooManyCalls(
                    f"{client_id} already has {self.limits.per_member} calls in progress, the "
                    "most one member may hold at once; wait for one to end before starting "
                    "another.")
            self._calls[client_id] += 1
        try:
            yield
        finally:
            with self._lock:
                _give_back(self._calls, client_id)

    @contextmanager
    def stream(self, client_id: str, *, end: Callable[[Exception], None]) -> Iterator[Watch]:
        """A stream slot of ``client_id`` (its own, if the open round assigned it work and
        it holds none yet; else a shared one) and the watch on the stream's waits:
        ``end(error)`` (called from the watchdog thread) ends the call when it waits too long."""
        assigned = self._assigned(client_id)  # asks the coordinator: not under this lock
        with self._lock:
            own = self._take_stream(client_id, assigned=assigned)
        try:
            watch = Watch(end=end, idle_s=self.limits.idle_s,
                          awaited_bytes=self.limits.message_bytes)
            with self._watching(watch):
                yield watch
        finally:
            with self._lock:
                _give_back(self._streams, client_id)
                if own:
                    self._own.discard(client_id)
                else:
                    self._shared -= 1

    def first_request(self, requests: Iterator[T], *, anonymous: bool,
                      end: Callable[[Exception], None]) -> T | None:
        """The call's first message (None if the peer sent none), waited for at most
        ``request_s`` (then ``end(StreamIdle)``); a call without a session waits in one of
        the ``anonymous`` slots (NoRequestSlot when all are taken)."""
        held = [False]  # an anonymous slot, given back once: when the watch ends the call
        if anonymous:  # (before its peer hears so) or when the call stops waiting
            with self._lock:
                if self._anonymous >= self.limits.anonymous:
                    raise NoRequestSlot(f"{self.limits.anonymous} calls without a session "
                                        "already wait for their request, the most the server "
                                        "takes; retry in a few seconds.")
                self._anonymous += 1
                held[0] = True

        def give_back() -> None:  # (lock held)
            if held[0]:
                held[0] = False
                self._anonymous -= 1

        def ending(error: Exception) -> None:  # (watchdog, which holds the lock)
            give_back()
            end(error)

        try:
            with self._watching(Watch(end=ending, idle_s=self.limits.request_s)) as watch:
                return next(watch.received(requests), None)
        finally:
            with self._lock:
                give_back()

    def _take_stream(self, client_id: str, *, assigned: bool) -> bool:
        """(lock held) Count a stream of ``client_id``; True if it is the member's own."""
        limits, held = self.limits, self._streams[client_id]
        if held >= limits.streams_per_member:
            raise TooManyCalls(
                f"{client_id} already has {limits.streams_per_member} streams in progress, "
                "the most one member may hold at once; finish one before opening another.")
        own = assigned and client_id not in self._own
        if own:
            self._own.add(client_id)
        else:
            room = limits.streams // 2 if held else limits.streams
            if self._shared >= room:
                raise NoStreamSlot(
                    f"{self._shared} of the server's {limits.streams} shared stream slots are "
                    f"in use, all that {'a second stream of a member' if held else 'a stream'} "
                    "may take; retry in a few seconds.")
            self._shared += 1
        self._streams[client_id] += 1
        return own

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


def _give_back(counts: Counter[str], client_id: str) -> None:
    counts[client_id] -= 1
    if not counts[client_id]:  # or every member ever seen would stay
        del counts[client_id]


class Watch:
    """One stream's waits on its peer. The handler's thread marks each wait through
    ``received`` or ``sent``; the watchdog thread ends the call in the middle of one that has
    lasted ``idle_s`` longer than its message needs at SLOWEST_LINK_BYTES_S (a message sent:
    its size; one awaited: ``awaited_bytes``), or that is still going on after the end set by
    ``until``. ``sent_bytes`` counts the bytes of the messages sent so far."""

    def __init__(self, *, end: Callable[[Exception], None], idle_s: float,
                 awaited_bytes: int = 0) -> None:
        self._end = end
        self._idle_s = idle_s
        self._awaited_bytes = awaited_bytes
        self._lock = threading.Lock()
        self._waiting_since: float | None = None  # time.monotonic() of the wait in progress
        self._allowed_s = 0.0  # ... and how long it may last
        self._until: tuple[float, Exception] | None = None
        self._ended: Exception | None = None  # why the watchdog ended the call
        self.sent_bytes = 0

    def received(self, messages: Iterator[T]) -> Iterator[T]:
        """A client stream's messages, each wait for the next one watched."""
        while True:
            self._wait(self._awaited_bytes)
            try:
                message = next(messages)
            except StopIteration:
                return
            finally:
                self._waited()
            yield message

    def sent(self, messages: Iterator[M]) -> Iterator[M]:
        """A server stream's messages, each wait for the peer to take one watched (gRPC
        resumes the handler's generator once the message it yielded has been sent)."""
        for message in messages:
            size = message.ByteSize()
            self.sent_bytes += size
            self._wait(size)
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
            if now - self._waiting_since >= self._allowed_s:
                self._ended = StreamIdle(
                    f"the stream waited {self._allowed_s:.3g} s for its peer to send or take a "
                    f"message, {self._idle_s:g} s more than the message needs at "
                    f"{SLOWEST_LINK_BYTES_S * 8 / 1e6:g} Mbit/s; it was ended. Send and read "
                    "without pausing.")
            elif self._until is not None and now >= self._until[0]:
                self._ended = self._until[1]
            else:
                return
            self._end(self._ended)

    def _wait(self, nbytes: int) -> None:
        with self._lock:
            self._waiting_since = time.monotonic()
            self._allowed_s = self._idle_s + nbytes / SLOWEST_LINK_BYTES_S

    def _waited(self) -> None:
        """The wait is over; raises the watchdog's error if it ended the call meanwhile (the
        peer hears it already: the handler must not go on)."""
        with self._lock:
            self._waiting_since = None
            if self._ended is not None:
                raise self._ended


class RequestGate(grpc.ServerInterceptor):
    """Serves every method as one that takes a stream of requests, so that its worker thread
    waits for the first message in ``CallSlots.first_request`` (bounded in number and time)
    instead of inside gRPC, where nothing can count or end the wait; a caller with a session
    holds one of its call slots from then to the call's end. ``identify`` maps a presented
    session token to its client id (None if unknown: the call counts as one without a
    session)."""

    def __init__(self, slots: CallSlots, identify: Callable[[str], str | None]) -> None:
        self.slots = slots
        self.identify = identify

    def intercept_service(self, continuation: Callable[..., grpc.RpcMethodHandler | None],
                          details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = continuation(details)
        if handler is None:
            return None
        token = dict(details.invocation_metadata).get(SESSION_METADATA_KEY)
        client_id = self.identify(token) if token else None
        behaviour = (handler.stream_stream or handler.stream_unary or handler.unary_stream
                     or handler.unary_unary)

        def admitted(requests: Iterator[Any], context: grpc.ServicerContext,
                     held: ExitStack) -> Any:
            """What the handler takes (its request, or all its messages), once the caller
            holds a call slot in ``held`` and the first message is here."""
            try:
                if client_id is not None:
                    held.enter_context(self.slots.call(client_id))
                first = self.slots.first_request(requests, anonymous=client_id is None,
                                                 end=lambda err: end_call(context, err))
            except CallRefused as err:
                context.abort(err.code, str(err))
            if first is None:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carried no request.")
            return itertools.chain([first], requests) if handler.request_streaming else first

        def answer(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            with ExitStack() as held:
                return behaviour(admitted(requests, context, held), context)

        def answers(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
            with ExitStack() as held:
                yield from behaviour(admitted(requests, context, held), context)

        wrap, gated = ((grpc.stream_stream_rpc_method_handler, answers)
                       if handler.response_streaming
                       else (grpc.stream_unary_rpc_method_handler, answer))
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
