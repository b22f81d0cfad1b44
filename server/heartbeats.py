"""Heartbeats answered by a process of their own ([server] heartbeat_port).

A member's heartbeat is a few dozen bytes and a dictionary write, but in the coordinator's
process it waits for the GIL behind everything else there: a thousand uploads being decoded,
the close, a thousand update streams starting at once. At 1,024 members that wait was seconds
(bench/many_members.py), and a member whose beats go unanswered for long is dropped. So the
coordinator can hand its heartbeats to a small process that does nothing else:

    door = HeartbeatDoor.start(sessions=..., news=..., apply=..., host=host, port=0)
    door.port              # members learn it from JoinReply.heartbeat_port
    door.stop()

The coordinator's side is handed what it needs, not the coordinator: its session tokens,
``news()`` (the rounds closed and the exclusions, ``Coordinator.beat_news``) and
``apply(beats)`` (``Coordinator.apply_beats``).

The door (``python -m matformer.server.heartbeats``, killed with the coordinator) answers
``Heartbeat`` on its own gRPC server and no other call. It holds a copy of what an answer
needs: the session tokens' hashes (each change taken by it, acknowledged, before the Join or
Leave making it returns, so a member never beats with a token its door has not heard of,
and a token its Leave revoked is refused there at once), the excluded
members and the rounds closed (sent every ``SYNC_S``). It answers at once and hands the beats
on every ``FORWARD_S``, each with when it arrived; the coordinator applies a batch under one
hold of its lock, dated when the door took each beat, not when the coordinator got to it.

What a beat reports is checked where the in-process beat checks it: its form at the door
(a speed that is not a finite, non-negative number is INVALID_ARGUMENT), the rest when it is
applied (a speed beyond any machine's, a relayed list from a member that is no relay, or one
the run cannot have): such a beat is dropped with a warning, where in process its call would
have been refused. A beat from a member the coordinator has since dropped is dropped too; the
member learns of it from its next call there, or from the door once its session is revoked.

The two processes talk over a socket pair, pickled tuples each way:
coordinator → door ``("sessions", {client id: token hash or None})``, ``("state", rounds
closed, {excluded client id: why})``; door → coordinator ``("ready", port)`` or ``("failed",
why)``, then ``("beats", [Beat, ...])``.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from matformer.protocol.auth import SessionTokens, presented_session
from matformer.protocol.channel import COORDINATOR_SERVICE, listen
from matformer.protocol.health import add_health
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.server.processes import die_with_parent

FORWARD_S = 0.2  # the door hands its beats on this often
ACK_S = 5.0  # a Join or Leave waits at most this long for the door to take its session change
SYNC_S = 0.2  # the coordinator sends its rounds closed and exclusions this often (on change)
START_S = 60.0  # the door's start, imports included, on a loaded machine
UNKNOWN_WAIT_S = 2.0  # a token of a client id the door has not heard of waits this long
UNKNOWN_WAITERS = 16  # beats waiting so at once; beyond them an unknown token is refused
WORKERS = 32  # the door's handler threads: a beat holds one for well under a millisecond
MAX_BEAT_BYTES = 4 * 2**20  # a relay's list of server.gate.MAX_RELAYED members fits

log = logging.getLogger("matformer.server.heartbeats")


class Beat(NamedTuple):
    """A heartbeat the door answered: whose, when it arrived (``time.monotonic()``, one clock
    for every process of the host) and what it reported (None: no speed; ``relayed``: a
    relay's members, (name, tier, tokens/s) each)."""

    client_id: str
    at: float
    tokens_per_second: float | None
    relayed: tuple[tuple[str, int, float], ...]


# -- the coordinator's side ------------------------------------------------------------------


News = Callable[[], tuple[int, dict[str, str]]]  # (rounds closed, excluded id → why)


class HeartbeatDoor:
    """The door process and the coordinator's threads talking to it: one sends what the door
    must know (``news``), one reads what it sends back (beats, and acknowledgements of
    session changes), one hands the beats on (``apply``, which waits for the coordinator's
    lock: the reader never does, so an acknowledgement is never stuck behind it)."""

    def __init__(self, sessions: SessionTokens, news: News,
                 apply: Callable[[list[Beat]], None], process: subprocess.Popen,
                 conn: Connection, port: int) -> None:
        self.sessions, self.news, self.apply = sessions, news, apply
        self.process = process
        self.port = port
        self._conn = conn
        self._sending = threading.Lock()  # sends come from handler threads and the syncer
        self._stopping = threading.Event()
        self._changes = 0  # session changes sent, numbered
        self._acked = 0  # ... and the last one the door has taken
        self._acks = threading.Condition()
        self._beats: queue.SimpleQueue[list[Beat] | None] = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._sync, name="matformer-door-sync",
                                          daemon=True),
                         threading.Thread(target=self._read, name="matformer-door-read",
                                          daemon=True),
                         threading.Thread(target=self._apply_beats,
                                          name="matformer-door-beats", daemon=True)]
        for thread in self._threads:
            thread.start()

    @classmethod
    def start(cls, *, sessions: SessionTokens, news: News, apply: Callable[[list[Beat]], None],
              host: str, port: int, cert: Path | None = None, key: Path | None = None
              ) -> HeartbeatDoor:
        """Start the door on ``host``:``port`` (0: any free port), TLS with ``cert`` and
        ``key`` when given, holding ``sessions`` as they are now and told of each change.
        Raises PortUnavailable when it cannot listen there."""
        from matformer.server.errors import PortUnavailable

        ours, theirs = socket.socketpair()
        argv = [sys.executable, "-m", "matformer.server.heartbeats", "--fd",
                str(theirs.fileno()), "--host", host, "--port", str(port)]
        if cert is not None and key is not None:
            argv += ["--cert", str(cert), "--key", str(key)]
        process = subprocess.Popen(argv, pass_fds=[theirs.fileno()])
        theirs.close()
        conn = Connection(ours.detach())
        try:
            if not conn.poll(START_S):
                raise PortUnavailable(f"the heartbeat process did not start within {START_S:g} "
                                      "s; see its output above.")
            kind, detail = conn.recv()
        except (EOFError, OSError):
            kind, detail = "failed", f"it exited with status {process.wait()}"
        if kind != "ready":
            process.kill()
            conn.close()
            raise PortUnavailable(
                f"the heartbeat process cannot serve on {host}:{port}: {detail}. Another "
                "process holds the port; choose [server] heartbeat_port (0: any free one).")
        door = cls(sessions, news, apply, process, conn, detail)
        # every token from now on reaches the door before its Join answers; those issued
        # before (a resumed run's) go first, the same way
        sessions.on_change = door._session_changed
        door._send(("sessions", sessions.as_dict()))
        return door

    def stop(self) -> None:
        self.sessions.on_change = None
        self._stopping.set()
        self._beats.put(None)
        with self._acks:
            self._acks.notify_all()
        self.process.kill()
        self.process.wait()
        self._conn.close()
        for thread in self._threads:
            thread.join(timeout=FORWARD_S + SYNC_S + 1)

    def _session_changed(self, client_id: str, hashed: str | None) -> None:
        """Send one session change and wait until the door has taken it (at most ACK_S):
        the Join or Leave making it answers after, so a revoked token is refused at the door
        from the moment its Leave returns."""
        with self._sending:
            self._changes += 1
            change = self._changes
        self._send(("sessions", {client_id: hashed}, change))
        with self._acks:
            taken = self._acks.wait_for(
                lambda: self._acked >= change or self._stopping.is_set(), timeout=ACK_S)
        if not taken:
            log.warning("the heartbeat process took %.0f s or more to take a session change "
                        "of %s; beats there may see the change late", ACK_S, client_id)

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._sending:
            try:
                self._conn.send(message)
            except (OSError, ValueError):  # the door is gone: stopping, or it died
                if not self._stopping.is_set():
                    log.error("the heartbeat process is gone (exit status %s); members' "
                              "beats there go unanswered. Restart the server.",
                              self.process.poll())
                    self._stopping.set()

    def _sync(self) -> None:
        """The rounds closed and the exclusions, sent whenever they changed."""
        sent = None
        while not self._stopping.wait(SYNC_S):
            now = self.news()
            if now != sent:
                self._send(("state", *now))
                sent = now

    def _read(self) -> None:
        """What the door sends: its beats (queued for ``_apply_beats``) and the number of
        the last session change it took."""
        while not self._stopping.is_set():
            try:
                kind, body = self._conn.recv()
            except (EOFError, OSError):
                self._beats.put(None)
                return
            if kind == "beats":  # plain tuples: the door's Beat is __main__'s
                self._beats.put([Beat(*beat) for beat in body])
            elif kind == "ack":
                with self._acks:
                    self._acked = max(self._acked, body)
                    self._acks.notify_all()

    def _apply_beats(self) -> None:
        while (beats := self._beats.get()) is not None:
            self.apply(beats)


# -- the door's side -------------------------------------------------------------------------


class DoorState:
    """What the door knows of the run, kept up by the coordinator's messages."""

    def __init__(self) -> None:
        self.sessions = SessionTokens()
        self.excluded: dict[str, str] = {}
        self.rounds = 0
        self.news = threading.Condition()  # notified on every message taken
        self.unknown_waiters = threading.BoundedSemaphore(UNKNOWN_WAITERS)

    def take(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        with self.news:
            if kind == "sessions":
                self.sessions.mirror(message[1])
            elif kind == "state":
                self.rounds, self.excluded = message[1], message[2]
            self.news.notify_all()

    def client_of(self, token: str) -> str | None:
        """The client id of ``token``; a token of a client id the door has not heard of yet
        waits a moment (``UNKNOWN_WAIT_S``) for the coordinator's news."""
        client_id = self.sessions.client_of(token)
        if (client_id is not None or self.sessions.holds(token.rpartition(".")[0])
                or not self.unknown_waiters.acquire(blocking=False)):
            return client_id
        try:
            deadline = time.monotonic() + UNKNOWN_WAIT_S
            with self.news:
                while (client_id := self.sessions.client_of(token)) is None:
                    left = deadline - time.monotonic()
                    if left <= 0 or not self.news.wait(left):
                        return self.sessions.client_of(token)
            return client_id
        finally:
            self.unknown_waiters.release()


class DoorService:
    """``Heartbeat`` of the Coordinator service, alone (``handler``): every other call of it
    is UNIMPLEMENTED here. The member RPCs keep their one servicer (server/service.py)."""

    def __init__(self, state: DoorState) -> None:
        self.state = state
        self._pending: dict[str, Beat] = {}
        self._lock = threading.Lock()

    def Heartbeat(self, request: pb.HeartbeatRequest,
                  context: grpc.ServicerContext) -> pb.HeartbeatReply:
        client_id = self.state.client_of(presented_session(context))
        if client_id is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "unknown, revoked or expired session token; call Join again.")
        reason = self.state.excluded.get(client_id)
        if reason is not None:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{client_id} was excluded from the run: {reason}")
        speed = request.tokens_per_second if request.HasField("tokens_per_second") else None
        if speed is not None and not (math.isfinite(speed) and speed >= 0):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"tokens_per_second {speed} is not a finite, non-negative speed.")
        relayed = tuple((m.name, m.tier, m.tokens_per_second) for m in request.relayed)
        with self._lock:
            earlier = self._pending.get(client_id)
            if speed is None and earlier is not None:
                speed = earlier.tokens_per_second  # a later beat without one keeps it
            self._pending[client_id] = Beat(client_id, time.monotonic(), speed, relayed)
        return pb.HeartbeatReply(round=self.state.rounds)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(COORDINATOR_SERVICE, {
            "Heartbeat": grpc.unary_unary_rpc_method_handler(
                self.Heartbeat, request_deserializer=pb.HeartbeatRequest.FromString,
                response_serializer=pb.HeartbeatReply.SerializeToString)})

    def taken(self) -> list[Beat]:
        """The beats since the last call, the latest of each member."""
        with self._lock:
            beats, self._pending = list(self._pending.values()), {}
        return beats


def serve(conn: Connection, host: str, port: int, cert: Path | None, key: Path | None
          ) -> None:
    """The door: answer beats until the coordinator goes (its end of ``conn`` closes)."""
    state = DoorState()
    service = DoorService(state)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS), options=(
        ("grpc.max_receive_message_length", MAX_BEAT_BYTES), ("grpc.so_reuseport", 0)))
    server.add_generic_rpc_handlers((service.handler(),))
    add_health(server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        bound = listen(server, address, cert=cert, key=key)
    except RuntimeError as err:  # grpc's word for a taken port
        conn.send(("failed", str(err)))
        return
    server.start()
    conn.send(("ready", bound))
    stopping = threading.Event()

    sending = threading.Lock()  # the forwarder's beats and the reader's acknowledgements

    def forward() -> None:
        while not stopping.wait(FORWARD_S):
            beats = service.taken()
            if beats:
                try:
                    with sending:
                        conn.send(("beats", [tuple(beat) for beat in beats]))
                except (OSError, ValueError):
                    return

    forwarder = threading.Thread(target=forward, name="matformer-door-forward", daemon=True)
    forwarder.start()
    try:
        while True:
            message = conn.recv()
            state.take(message)
            if message[0] == "sessions" and len(message) > 2:  # a numbered change: taken
                with sending:
                    conn.send(("ack", message[2]))
    except (EOFError, OSError):  # the coordinator stopped
        pass
    finally:
        stopping.set()
        server.stop(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m matformer.server.heartbeats",
                                     description="The coordinator's heartbeat process: "
                                                 "started by the server, not by hand.")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--cert", type=Path)
    parser.add_argument("--key", type=Path)
    args = parser.parse_args(argv)
    die_with_parent()
    os.set_inheritable(args.fd, False)
    serve(Connection(args.fd), args.host, args.port, args.cert, args.key)


if __name__ == "__main__":
    main()
