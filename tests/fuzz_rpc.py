"""Fuzz every Coordinator RPC with random and mutated messages against a real server on
loopback, the root or a relay in front of it (or, ``--target http``, the root's HTTP side:
tests/fuzz_http.py): the server must never crash, and a call it rejects must leave the run
as it was.

    python tests/fuzz_rpc.py --examples 2000 --seconds 120 --seed 0
    python tests/fuzz_rpc.py --target relay    # the same RPCs to a relay in front of the root
    python tests/fuzz_rpc.py --target http     # the root's HTTP side (tests/fuzz_http.py)

The target (``--target``) is the root coordinator itself (``RootTarget``), or a relay in front
of it (``RelayTarget``, ``fuzz_relay``): the relay serves its members the same RPCs through
the same servicer, and is the root's only member. Either way the fuzzed calls and the honest
members' calls go to the target, and the rounds that must move on are the root's.

Each case (drawn by hypothesis) picks an RPC, a session (none, forged, garbage, revoked, a
live member's, or one with work in the open round) and a request: random fields, a valid
request with one field replaced (nested fields too, such as capabilities.tokens_per_second),
a valid request with one number at an edge of its type (NaN, inf, 5e-324, 2**64 - 1, ...),
a valid request's bytes with bits flipped and bytes inserted or deleted, or (SubmitResult) a
valid submission with one tensor of one result declared off the run's layout (``off_layout``:
a narrow integer dtype, counts a few off or many times over, or an enormous shape over a few
bytes). The run sends top-k results, so ids and positions travel narrow. Requests travel as
raw bytes, so bytes that do not parse reach the server too (gRPC itself answers those
INTERNAL "Exception deserializing request!", listed as ``INTERNAL(unparseable)``).

A crash is a call ending UNKNOWN (an exception escaped a handler) or any other INTERNAL, a
call still running after ``CALL_TIMEOUT_S``, a failed health check, or an error logged by
gRPC, the coordinator (its tick thread included) or the relay (the root refusing it). After
every call that ends in an error status, the target's snapshot must be unchanged. The root's
(``snapshot``): state.json and the live run state, members and session tokens, the work
queue, the open round (assignments, who submitted what), the master's weight hash, every
other file of the run directory and the bytes counted as received; all but what a refusal
changes on purpose (``_uncounted``, ``_members``). The relay's (``relay_snapshot``): its
members and sessions, the root's rounds it holds (each member's part and what it delivered),
its counts and its caches of the root's updates and files.

An accepted input can also break the run later: a Join with a speed of inf once made every
later round fail to open. So every ``--round-every`` cases, and once at the end, the
fuzzer's two honest members move the run one round on as clients would (``honest_round``):
GetRound, FetchSequences of their assignment, a valid SubmitResult, and the root's round
closes (at its deadline, or the relay's, when fuzzed members hold work too); every call must
answer OK, the root's round index must go up by one with the next round open, and state.json
must hold only finite numbers. A failure there is a crash, listed with the cases since the
last good round, and fuzzing stops: every later call would fail the same way. When fuzzing
ends the honest members leave, so that another fuzzer may take their names.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc
import torch
from google.protobuf import text_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from hypothesis.errors import FlakyStrategyDefinition
from support.helpers import Clock, served_run_toml

from matformer.modeling.checkpoint.manifest import MANIFEST_NAME
from matformer.modeling.compression import weight_hash
from matformer.protocol.auth import SessionTokens, session_metadata
from matformer.protocol.channel import COORDINATOR_SERVICE, GRPC_OPTIONS
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.protocol.sparse import encode_sparse_result
from matformer.protocol.tensors import DTYPES
from matformer.relay.main import Access, RunningRelay
from matformer.relay.relay import Relay
from matformer.relay.rounds import RelayMember
from matformer.server.config import RunConfig
from matformer.server.coordinator import Coordinator
from matformer.server.main import RunningServer
from matformer.server.membership import Member
from matformer.server.rounds import RoundAssignment

JOIN_TOKEN = "fuzz-join-token"
RELAY_TOKEN = "fuzz-relay-token"  # grants the relay role at the root ([auth] relay_token)
OPERATOR_TOKEN = "fuzz-operator-token"  # the HTTP side's writes ([auth] operator_token)
RUN_ID = "fuzz"
CALL_TIMEOUT_S = 30.0
UNPARSEABLE = "Exception deserializing request!"  # gRPC's own answer to bytes that do not parse
METHODS = pb.DESCRIPTOR.services_by_name["Coordinator"].methods_by_name
RPCS = sorted(METHODS)
HONEST = ("honest-0", "honest-1")  # the fuzzer's own members: together they open a round
ROUND_EVERY = 10  # cases between honest rounds (one round costs about two cases' time)
HONEST_DEADLINES = 8  # deadlines an honest round may take: members that never deliver lose
# half their share at each, so the honest members' share grows
SPEED = 1000.0  # tokens/s, as the fuzzer's members report and show it
HOWS = ["random", "one field", "one number", "mutated"]  # how a request is made (request())
# every RPC made every way; a SubmitResult also with results off the run's layout (issue 30)
PAIRS = [(rpc, how) for rpc in RPCS
         for how in ([*HOWS, "off layout"] if rpc == "SubmitResult" else HOWS)]
OFF_LAYOUT_BYTES = 1 << 20  # the most bytes an off-layout tensor gets to match its shape
# The root's [faults] heartbeat_s under a relay: how soon the relay learns of a close (its
# heartbeat's answer says), which its answers to its members then say
RELAY_HEARTBEAT_S = 0.2
# what the relay logs when the root refuses it: an error, as the coordinator's own would be
RELAY_FAILURES = ("heartbeat to the root failed", "the root answered")

@dataclass
class FuzzReport:
    tried: int = 0
    accepted: int = 0
    rejected: int = 0
    codes: Counter[tuple[str, str]] = field(default_factory=Counter)  # (rpc, status) → calls
    crashes: list[str] = field(default_factory=list)  # what happened, per crash
    state_changes: list[str] = field(default_factory=list)  # rejected calls that changed state
    hows: Counter[tuple[str, str]] = field(default_factory=Counter)  # (rpc, how) → cases
    rounds: int = 0  # honest rounds completed between the cases
    reseeded: int = 0  # times hypothesis stopped on draws that depend on the server's state

    def table(self) -> str:
        """Calls per RPC (or route) and status code, one row each."""
        statuses = sorted({code for _, code in self.codes})
        rows = [["called", "tried", *statuses]]
        for name in sorted({name for name, _ in self.codes}):
            counts = [self.codes[name, code] for code in statuses]
            rows.append([name, str(sum(counts)), *map(str, counts)])
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = ("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
                 for row in rows)
        return "\n".join(lines)

    def check_unchanged(self, what: str, before: dict[str, str], after: dict[str, str]) -> None:
        """The snapshots before and after a refused call (``what``): a part that differs is
        a state change."""
        changed = [f"{k} ({difference(before[k], after[k])})" for k in sorted(before)
                   if before[k] != after[k]]
        if changed:
            self.state_changes.append(f"{what} changed {'; '.join(changed)}")


@contextlib.contextmanager
def fuzz_server(directory: Path, *, min_clients: int = 2, heartbeat_s: float = 5.0
                ) -> Iterator[RunningServer]:
    """A coordinator on loopback (ephemeral ports) for a tiny run in ``directory``. Its
    clients are never excluded, so the honest members keep their sessions. Its clock stands
    still while fuzzing (``Clock``): no call changes state by the clock; each honest round
    moves it at most one deadline on, far less than a member's timeouts. It admits a relay
    (``RELAY_TOKEN``), and its HTTP side takes the operator's writes (``OPERATOR_TOKEN``)."""
    directory.mkdir(parents=True, exist_ok=True)
    toml = served_run_toml(
        directory, run={"id": RUN_ID, "dir": "run"},
        round={"min_clients": min_clients, "deadline_s": 60.0, "tokens_per_round": 1024,
               "rounds": 1000000},
        faults={"heartbeat_timeout_s": 3600.0, "session_ttl_s": 7200.0, "max_rejections": 0,
                "heartbeat_s": heartbeat_s},
        compression={"encoding": "topk", "chunk": 8, "topk": 4},  # int8 and int16 ids, positions
        auth={"join_token": JOIN_TOKEN, "relay_token": RELAY_TOKEN,
              "operator_token": OPERATOR_TOKEN})
    server = RunningServer.start(RunConfig.load(toml), grpc_port=0, http_port=0)
    try:
        yield server
    finally:
        server.stop()


def join_request(server: RunningServer, name: str) -> pb.JoinRequest:
    """A Join the coordinator accepts."""
    return pb.JoinRequest(
        run_id=RUN_ID, join_token=JOIN_TOKEN, client_name=name,
        capabilities=pb.Capabilities(device_kind="cpu", memory_bytes=2**34, requested_tier=0,
                                     tokens_per_second=SPEED, load_strategy="auto"),
        schema=pb.Schema(canonical_hash=server.coordinator.schema_hash))


def valid_submission(target: Target, client_id: str) -> list[pb.SubmitMessage]:
    """The SubmitResult stream ``client_id`` would send ``target`` now: results encoded with
    the run's settings at its tier for every parameter, trained at ``SPEED``."""
    c = target.server.service.coordinator  # the run: its parameters, tier regions, settings
    assignment = target.assignment_for(client_id)
    member = target.member(client_id)
    regions = c.regions(member.tier if member is not None else 0)
    tokens = assignment.tokens if assignment is not None else 1
    header = pb.SubmitHeader(round=assignment.round if assignment else c.state.round,
                             client_id=client_id, tokens=tokens, loss=3.0,
                             train_seconds=tokens / SPEED,
                             assignment_id=assignment.assignment_id if assignment else "")
    messages = [pb.SubmitMessage(header=header)]
    compressor = c.config.compression.build()
    for name in sorted(c.shapes):
        values = torch.full([b - a for a, b in regions[name]], 0.01)
        result = compressor.encode(name, values, shape=c.shapes[name], region=regions[name],
                                   tokens=tokens)
        messages.append(pb.SubmitMessage(result=encode_sparse_result(result)))
    return messages


def snapshot(server: RunningServer) -> dict[str, str]:
    """What a rejected call must not change, as JSON per part (see the module docstring)."""
    c = server.service.coordinator
    with c._lock:  # the coordinator's own lock: no handler or tick changes it meanwhile
        # state.json is written from the live run first, so that what earlier calls changed
        # unsaved (an event, which marks nothing unsaved) is not taken for a refusal's doing
        # when the refusal's save writes it; a failing save is for the next honest round to
        # report
        with contextlib.suppress(Exception):
            c.mark_unsaved()
            c.flush()
        rnd = c.current_round
        open_round = None if rnd is None else {
            "index": rnd.index, "opened_at": rnd.opened_at, "deadline": rnd.deadline,
            "assignments": {k: dataclasses.asdict(a) for k, a in rnd.assignments.items()},
            "submissions": {k: [sorted((r.name, r.region) for r in s.results), s.wire_bytes]
                            for k, s in rnd.submissions.items()},
            "queue_before": rnd.queue_before}
        files = {str(p.relative_to(c.dir)): hashlib.sha256(p.read_bytes()).hexdigest()
                 for p in sorted(c.dir.rglob("*")) if p.is_file() and p.name != "state.json"}
        parts = {
            "state.json": _uncounted(json.loads((c.dir / "state.json").read_text())),
            "state": _uncounted(dataclasses.asdict(c.state)),
            "membership": _members(c.membership.to_dict()),
            "queue": c.queue.to_dict(), "open_round": open_round,
            "master": weight_hash(c.master), "files": files}
    return {k: json.dumps(v, sort_keys=True, default=str) for k, v in parts.items()}


def _uncounted(state: dict) -> dict:
    """Run state without what a refused call may change on purpose: the count of refused
    submissions ("reject" events; [faults] max_rejections), and the copies of members and
    queue that every save takes (a refusal saves, so they catch up with earlier accepted
    calls; the live members and queue are compared apart, all but ``last_seen``, which
    ``submit`` refreshes before it checks, and ``rejections``)."""
    state.pop("membership")
    state.pop("queue")
    state["events"] = [e for e in state["events"] if e["kind"] != "reject"]
    return state


def _members(membership: dict) -> dict:
    for member in membership["members"]:
        member.pop("last_seen")
        member.pop("rejections")
    return membership


def relay_snapshot(relay: Relay) -> dict[str, str]:
    """What a call the relay refuses must not change, as JSON per part: its members (all but
    ``last_seen``, which a member's call refreshes before it is checked) and sessions, the
    root's rounds it holds (each member's part, and what it delivered), its counts (members
    it admitted, the join bucket, the ids rounding owes each member, the root's rounds it
    knows of and handed in) and its caches of the root's updates and checkpoint files, with
    the folder those files live in. The counts are the relay's private fields: nothing else
    shows them."""
    with relay._changed:  # the relay's own lock: no handler or thread of it changes it meanwhile
        members = {client: {k: v for k, v in dataclasses.asdict(m).items() if k != "last_seen"}
                   for client, m in relay.members.items()}
        held = [{"work": dataclasses.asdict(h.work), "sequences": sorted(h.sequences),
                 "opened": h.opened, "deadline": h.deadline, "missed": sorted(h.missed),
                 "parts": {client: {
                     "assignment": dataclasses.asdict(part.assignment),
                     "results": None if part.results is None else
                     sorted((r.name, r.region) for r in part.results),
                     "loss": part.loss, "delivered_at": part.delivered_at}
                     for client, part in h.parts.items()}}
                for h in relay.held]
        counts = {"admitted": relay._next_id, "joins": relay._joins.bucket, "owed": relay._owed,
                  "root_round": relay.root_round, "run_tokens": relay.run_tokens,
                  "rounds_submitted": relay.rounds_submitted, "started": relay.started,
                  "finished": relay.finished}
    caches = {"updates fetched": relay.updates.fetched, "updates served": relay.updates.served,
              "files fetched": relay.files.fetched, "files asked for": len(relay.files._locks)}
    folder = {str(p.relative_to(relay.folder)):
              hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "folder"
              for p in sorted(relay.folder.rglob("*"))}
    parts = {"members": members, "sessions": relay.sessions.as_dict(), "held": held,
             "counts": counts, "caches": caches, "folder": folder}
    return {k: json.dumps(v, sort_keys=True, default=str) for k, v in parts.items()}


# -- targets: what the fuzzed and the honest members call --------------------------------------

class Target(Protocol):
    """Where members call (``port``), serving the run of ``server`` (the root), and how that
    run moves on between calls."""

    server: RunningServer  # the root: its rounds are the ones the honest members move on
    port: int  # the gRPC port members call
    sessions: SessionTokens  # of the target's members

    def member(self, client_id: str) -> Member | RelayMember | None: ...

    def assignment_for(self, client_id: str) -> RoundAssignment | None: ...

    def freeze(self) -> None: ...  # the fuzzer's clocks: no call changes state by the clock

    def snapshot(self) -> dict[str, str]: ...  # what a refused call must not change

    def settle(self, failed: Callable[[], bool]) -> None: ...  # until nothing moves unasked

    def pass_deadline(self) -> None: ...  # move the clocks past the deadline that holds on


class RootTarget:
    """The root coordinator: members call it."""

    def __init__(self, server: RunningServer) -> None:
        self.server = server
        self.port = server.grpc_port
        self.coordinator = server.service.coordinator
        self.sessions = self.coordinator.membership.sessions
        self.clock = Clock()

    def member(self, client_id: str) -> Member | None:
        return self.coordinator.membership.members.get(client_id)

    def assignment_for(self, client_id: str) -> RoundAssignment | None:
        return self.coordinator.assignment_for(client_id)

    def freeze(self) -> None:
        self.clock.now = self.coordinator.clock()
        self.coordinator.clock = self.clock

    def snapshot(self) -> dict[str, str]:
        return snapshot(self.server)

    def settle(self, failed: Callable[[], bool]) -> None:
        _wait_for_close(self.coordinator, failed)

    def pass_deadline(self) -> None:
        """At the open round's deadline the round closes, or opens again if nobody delivered,
        on the honest members' next calls."""
        c = self.coordinator
        rnd = c.current_round
        if rnd is None:
            raise _Unserved(f"no round is open in round {c.state.round} (phase {c.phase}), "
                            "though both honest members call")
        self.clock.now = max(self.clock.now, rnd.deadline)


class SkippingClock:
    """A clock that runs (``time.monotonic``), and jumps ahead when told (``skip_to``)."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.skipped

    def skip_to(self, when: float) -> None:
        self.skipped += max(when - self(), 0.0)


class RelayTarget:
    """A relay in front of the root, the root's only member (``fuzz_relay``): members call the
    relay, which holds the root's open round and splits it among them. The relay's clock runs
    (it paces its calls to the root by it) and skips to a held round's deadline when an honest
    round waits on it; the root's stands still."""

    def __init__(self, server: RunningServer, running: RunningRelay) -> None:
        self.server = server
        self.root = RootTarget(server)
        self.port = running.port
        self.relay = running.relay
        self.sessions = self.relay.sessions
        self.clock = SkippingClock()

    def member(self, client_id: str) -> RelayMember | None:
        return self.relay.members.get(client_id)

    def assignment_for(self, client_id: str) -> RoundAssignment | None:
        return self.relay.assignment_for(client_id, None)

    def freeze(self) -> None:
        self.root.freeze()
        self.relay.clock = self.clock

    def snapshot(self) -> dict[str, str]:
        return relay_snapshot(self.relay)

    def settle(self, failed: Callable[[], bool]) -> None:
        """Until the relay's threads and the root's close worker have done what the last calls
        set off (``_moving``), or ``failed()``: an error was logged."""
        give_up = time.monotonic() + CALL_TIMEOUT_S
        while time.monotonic() < give_up and not failed() and self._moving():
            time.sleep(0.01)

    def pass_deadline(self) -> None:
        """At the relay's deadline it hands in what its members delivered, naming the rest
        missed, and the root's round closes; when none delivered, it takes the root's round
        again and splits it anew."""
        with self.relay._changed:
            if not self.relay.held:
                raise _Unserved(f"the relay holds no round of the root's (round "
                                f"{self.server.service.coordinator.state.round}), though both "
                                "honest members call it")
            self.clock.skip_to(self.relay.held[0].deadline)
            self.relay._changed.notify_all()  # its round thread looks at the clock now

    def _moving(self) -> bool:
        """Whether the root or the relay is about to change something unasked: the root closes
        a round, or opens one for a relay with members ready; the relay hands in a round that
        is done, takes the root's round (its members ready), or has yet to learn of a close."""
        c, relay = self.server.service.coordinator, self.relay
        with c._lock:
            if c.pipeline.closing is not None or c.pipeline.ready(c.clock()) is not None:
                return True
            closed, opened = c.state.round, c.current_round is not None
        owed = c.assignment_for(relay.root.client_id) is not None
        with relay._changed:
            held = relay.held[:1]
            if held and held[0].done(relay.clock()):
                return True
        if relay.closed_rounds() < closed:
            return True
        # with members ready, the root opens a round for the relay and the relay takes it
        return relay.speed() > 0 and (not opened or (not held and owed))


def relay_log(line: str) -> None:
    """The relay's log as Python logging: the root refusing the relay (``RELAY_FAILURES``)
    is an error, as the coordinator's own would be; the rest is information."""
    level = logging.ERROR if line.startswith(RELAY_FAILURES) else logging.INFO
    logging.getLogger("matformer.relay").log(level, "%s", line)


@contextlib.contextmanager
def fuzz_relay(directory: Path) -> Iterator[RelayTarget]:
    """The fuzz run's root (``fuzz_server``, in ``directory``) with a relay in front of it,
    the root's only member: the root opens its rounds for the relay alone, and tells it of
    each close within ``RELAY_HEARTBEAT_S``. The relay's members join with the run's join
    token and are never taken for silent (as the root's clients are never excluded); its
    checkpoint files are kept in ``directory``/relay."""
    with fuzz_server(directory, min_clients=1, heartbeat_s=RELAY_HEARTBEAT_S) as server:
        running = RunningRelay.start(f"127.0.0.1:{server.grpc_port}", name="relay-fuzz",
                                     access=Access(RELAY_TOKEN, JOIN_TOKEN),
                                     folder=directory / "relay", log=relay_log)
        running.relay.member_timeout_s = 3600.0
        try:
            yield RelayTarget(server, running)
        finally:
            running.stop("fuzzed")


# -- strategies -----------------------------------------------------------------------------

INT64 = st.one_of(st.integers(-3, 300), st.integers(-2**63, 2**63 - 1))
UINT64 = st.one_of(st.integers(0, 300), st.integers(0, 2**64 - 1))
UINT32 = st.one_of(st.integers(0, 8), st.integers(0, 2**32 - 1))
FLOATS = st.one_of(st.floats(-1e4, 1e4), st.floats(allow_nan=True, allow_infinity=True))
TEXT = st.one_of(st.text(max_size=20), st.text(max_size=300))
INDEX = st.integers(0, 2**16)
ASCII_TOKEN = st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=60)
# The edges of each number type: what a range check must refuse, or the run must survive
# (5e-324 s of training for any tokens is an infinite speed).
EDGES = {FieldDescriptor.CPPTYPE_DOUBLE: (math.nan, math.inf, -math.inf, 5e-324, 1e-300, 1e308,
                                          -1.0, 0.0),
         FieldDescriptor.CPPTYPE_INT64: (-2**63, -1, 0, 2**63 - 1),
         FieldDescriptor.CPPTYPE_UINT64: (0, 2**63, 2**64 - 1),
         FieldDescriptor.CPPTYPE_INT32: (-2**31, -1, 0, 2**31 - 1),
         FieldDescriptor.CPPTYPE_UINT32: (0, 2**31, 2**32 - 1)}


@st.composite
def tensors(draw: st.DrawFn) -> pb.Tensor:
    dtype = draw(st.one_of(st.sampled_from(sorted(DTYPES)), TEXT))
    shape = draw(st.lists(st.one_of(st.integers(0, 6), INT64), max_size=3))
    size = 1
    for dim in shape:
        size *= max(dim, 0)
    itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size() if dtype in DTYPES else 1
    exact = size * itemsize <= 4096 and draw(st.booleans())
    data = draw(st.binary(min_size=size * itemsize, max_size=size * itemsize) if exact
                else st.binary(max_size=64))
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


def sparse_results(names: list[str]) -> st.SearchStrategy[pb.SparseResult]:
    ranges = st.builds(pb.Range, start=INT64, stop=INT64)
    return st.builds(
        pb.SparseResult, name=st.one_of(st.sampled_from(names), TEXT),
        shape=st.lists(INT64, max_size=3), region=st.lists(ranges, max_size=3),
        encoding=st.one_of(st.sampled_from(["dense", "topk", "dct"]), TEXT),
        chunk=st.lists(INT64, max_size=3), chunks=tensors(), indices=tensors(),
        values=tensors(), tokens=INT64)


def headers(client_ids: list[str]) -> st.SearchStrategy[pb.SubmitHeader]:
    return st.builds(pb.SubmitHeader, round=UINT64,
                     client_id=st.sampled_from(client_ids or ["client-0"]) | TEXT,
                     tokens=UINT64, loss=FLOATS, train_seconds=FLOATS)


def requests(rpc: str, names: list[str], client_ids: list[str]) -> st.SearchStrategy:
    """Random requests of ``rpc``: a message, or for SubmitResult a list of them."""
    if rpc == "Join":
        caps = st.builds(pb.Capabilities, device_kind=TEXT, device_name=TEXT,
                         memory_bytes=UINT64, requested_tier=UINT32, tokens_per_second=FLOATS,
                         load_strategy=TEXT, microbatch_tokens=UINT64)
        schema = st.builds(pb.Schema, local_hash=TEXT, canonical_hash=TEXT,
                           parameter_count=UINT64, tier=UINT32, sliced=st.booleans())
        return st.builds(pb.JoinRequest, run_id=st.sampled_from([RUN_ID, ""]) | TEXT,
                         join_token=st.sampled_from([JOIN_TOKEN, ""]) | TEXT,
                         capabilities=caps, schema=st.none() | schema, client_name=TEXT)
    if rpc == "Heartbeat":
        return st.builds(pb.HeartbeatRequest, round=UINT64,
                         tokens_per_second=st.none() | FLOATS)
    if rpc == "FetchSequences":
        return st.builds(pb.FetchSequencesRequest, ids=st.lists(UINT64, max_size=8))
    if rpc == "GetUpdates":
        return st.builds(pb.GetUpdatesRequest, since_round=UINT64)
    if rpc == "DownloadCheckpoint":
        paths = st.sampled_from(["", ".", "..", "../state.json", "/etc/passwd", "round-0",
                                 f"round-0/{MANIFEST_NAME}", f"round-9/{MANIFEST_NAME}",
                                 "round-0/\x00", "a" * 5000])
        return st.builds(pb.DownloadCheckpointRequest, path=paths | TEXT)
    if rpc == "Leave":
        return st.builds(pb.LeaveRequest, reason=TEXT)
    if rpc == "SubmitResult":
        header = headers(client_ids)
        item = st.one_of(st.builds(pb.SubmitMessage, header=header),
                         st.builds(pb.SubmitMessage, result=sparse_results(names)),
                         st.just(pb.SubmitMessage()))
        return st.one_of(st.tuples(st.builds(pb.SubmitMessage, header=header),
                                   st.lists(item, max_size=4)).map(lambda t: [t[0], *t[1]]),
                         st.lists(item, max_size=4))
    return st.just(getattr(pb, METHODS[rpc].input_type.name)())  # GetRound, GetCheckpoint


@st.composite
def off_layout(draw: st.DrawFn, message: pb.SubmitMessage) -> pb.SubmitMessage:
    """A valid result with one tensor declared anew: a narrow integer dtype (or its own), one
    dimension a few counts off, many times over, or enormous; bytes to match, where that is
    at most ``OFF_LAYOUT_BYTES``, else a few."""
    out = pb.SubmitMessage()
    out.CopyFrom(message)
    tensor = getattr(out.result, draw(st.sampled_from(["chunks", "indices", "values"])))
    tensor.dtype = draw(st.sampled_from(["int8", "uint8", "int16", tensor.dtype]))
    shape = list(tensor.shape) or [1]
    dim = draw(st.integers(0, len(shape) - 1))
    shape[dim] = draw(st.one_of(st.integers(max(shape[dim] - 2, 0), shape[dim] + 2),
                                st.sampled_from([shape[dim] * 64, 2**20, 2**40, 2**62])))
    tensor.shape[:] = shape
    size = math.prod(shape) * torch.empty((), dtype=DTYPES[tensor.dtype]).element_size()
    tensor.data = bytes(size) if size <= OFF_LAYOUT_BYTES else draw(st.binary(max_size=64))
    return out


@st.composite
def mutated(draw: st.DrawFn, blob: bytes) -> bytes:
    """``blob`` with a few bits flipped, bytes replaced, inserted or deleted; positions lean
    to the first bytes, where the field tags and lengths are."""
    out = bytearray(blob)
    position = st.one_of(st.integers(0, 48), st.integers(0, 2**24))
    for kind, at, byte in draw(st.lists(st.tuples(st.sampled_from("frid"), position,
                                                  st.integers(0, 255)), min_size=1, max_size=6)):
        i = at % (len(out) + 1)
        if kind == "i":
            out.insert(i, byte)
        elif i < len(out) and kind == "f":
            out[i] ^= 1 << (byte % 8)
        elif i < len(out) and kind == "r":
            out[i] = byte
        elif i < len(out):
            del out[i]
    return bytes(out)


# -- running one case -----------------------------------------------------------------------

class ErrorLog(logging.Handler):
    """Errors logged by any thread (gRPC's handler wrapper, the coordinator's tick, the
    relay, uvicorn)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == "grpc._common" and "deserializing" in record.getMessage():
            return  # gRPC's own refusal of bytes that do not parse, counted as a status
        cause = record.exc_info[1] if record.exc_info else None
        said = f"{record.name}: {record.getMessage()}"
        self.records.append(said if cause is None else f"{said} ({cause!r})")


def _invoke(channel: grpc.Channel, rpc: str, payload: bytes | list[bytes],
            metadata: tuple[tuple[str, str], ...]) -> tuple[str, bytes | None]:
    """Send raw request bytes; the status name and the (first) reply's bytes."""
    method, path = METHODS[rpc], f"/{COORDINATOR_SERVICE}/{rpc}"
    try:
        if method.client_streaming:
            reply = channel.stream_unary(path)(iter(payload), timeout=CALL_TIMEOUT_S,
                                               metadata=metadata)
        elif method.server_streaming:
            replies = list(channel.unary_stream(path)(payload, timeout=CALL_TIMEOUT_S,
                                                      metadata=metadata))
            reply = replies[0] if replies else b""
        else:
            reply = channel.unary_unary(path)(payload, timeout=CALL_TIMEOUT_S, metadata=metadata)
    except grpc.RpcError as err:
        code = err.code().name
        if err.code() == grpc.StatusCode.INTERNAL and err.details() == UNPARSEABLE:
            code = "INTERNAL(unparseable)"
        return code, (err.details() or "").encode()
    return "OK", reply


class _Unserved(Exception):
    """An honest member's call failed, or the run it left behind is damaged."""


@contextlib.contextmanager
def _step(what: str) -> Iterator[None]:
    """An honest member's call: any status but OK is the run failing it."""
    try:
        yield
    except grpc.RpcError as err:
        raise _Unserved(f"{what} answered {err.code().name}: {(err.details() or '')[:300]!r}"
                        ) from None


def _finite_state(path: Path) -> None:
    """_Unserved if state.json holds NaN or ±Infinity (Python's json writes them, and reads
    them back, unless told not to): a run that saved one fails again after a restart."""
    def refuse(constant: str) -> None:
        raise _Unserved(f"{path.name} holds {constant}")
    json.loads(path.read_text(), parse_constant=refuse)


class RpcFuzzer:
    """Cases against ``target`` over ``channel`` (a channel to its port), and the honest
    members' rounds between them; what it finds goes into ``report``."""

    def __init__(self, target: Target, channel: grpc.Channel, report: FuzzReport, *,
                 round_every: int) -> None:
        self.target, self.channel, self.report = target, channel, report
        self.round_every = round_every
        self.health = health_pb2_grpc.HealthStub(channel)
        self.stub = pb_grpc.CoordinatorStub(channel)
        self.errors = ErrorLog()
        self.revoked: list[str] = []
        self.names = sorted(target.server.service.coordinator.shapes)
        target.freeze()
        self.honest: dict[str, pb.JoinReply] = {}  # name → its Join's answer
        # client id → session token, of every Join answered OK: the coordinator keeps only
        # their hashes
        self.tokens: dict[str, str] = {}
        # each case since the last honest round: what happened, its rpc, and its request
        # if accepted (a refused one is checked to have changed nothing)
        self.since_round: list[tuple[str, str, bytes | list[bytes] | None]] = []
        self.stopped = False  # the run stopped serving honest members

    def honest_members(self) -> list[pb.JoinReply]:
        """The honest members' sessions; one that a fuzzed Leave ended joins again."""
        for name in HONEST:
            joined = self.honest.get(name)
            if joined is None or self.target.sessions.client_of(joined.session_token) is None:
                with _step(f"{name}'s Join"):
                    joined = self.stub.Join(join_request(self.target.server, name),
                                            timeout=CALL_TIMEOUT_S)
                self.honest[name] = joined
                self.tokens[joined.client_id] = joined.session_token
        return [self.honest[name] for name in HONEST]

    def leave(self) -> None:
        """The honest members leave, as clients do when they stop: their names are free for
        the next fuzzer of the same target."""
        for joined in self.honest.values():
            with contextlib.suppress(grpc.RpcError):  # a fuzzed Leave ended it already
                self.stub.Leave(pb.LeaveRequest(reason="fuzzing ends"), timeout=CALL_TIMEOUT_S,
                                metadata=session_metadata(joined.session_token))

    def honest_round(self) -> None:
        """Move the run one round on as honest members would; _Unserved if any step fails
        (see the module docstring)."""
        c = self.target.server.service.coordinator  # the root: its rounds are the run's
        seen_errors = len(self.errors.records)

        def failed() -> bool:  # a close failed: no need to wait on
            return len(self.errors.records) > seen_errors

        members = self.honest_members()
        start = c.state.round
        for deadlines in range(HONEST_DEADLINES + 1):
            self.target.settle(failed)  # a relay takes the root's round before it splits it
            for member in members:
                self.train(member, start)
            self.target.settle(failed)
            if failed():
                raise _Unserved(f"logged: {self.errors.records[seen_errors]}")
            if c.state.round > start:
                break
            if deadlines == HONEST_DEADLINES:
                raise _Unserved(f"round {start} did not close with the honest members' results "
                                f"within {HONEST_DEADLINES} deadlines")
            # Fuzzed members hold work too (or only they do): the deadline that holds the
            # round passes
            self.target.pass_deadline()
        for member in members:
            with _step(f"{member.client_id}'s GetRound after round {start}"):
                work = self.stub.GetRound(pb.GetRoundRequest(),
                                          metadata=session_metadata(member.session_token),
                                          timeout=CALL_TIMEOUT_S)
            if work.round != start + 1:
                raise _Unserved(f"{member.client_id}'s GetRound after round {start} answered "
                                f"round {work.round}")
        rnd = c.current_round
        if rnd is None or rnd.index != start + 1:
            raise _Unserved(f"round {start + 1} did not open after round {start} closed "
                            f"(phase {c.phase}), though both honest members call")
        c.flush()
        _finite_state(c.dir / "state.json")
        if len(self.errors.records) > seen_errors:
            raise _Unserved(f"logged: {self.errors.records[seen_errors]}")
        self.report.rounds += 1
        self.since_round.clear()

    def train(self, member: pb.JoinReply, round_index: int) -> None:
        """An honest member's part of round ``round_index``: its assignment, its sequences and
        valid results, if it has work there."""
        auth = session_metadata(member.session_token)
        with _step(f"{member.client_id}'s GetRound in round {round_index}"):
            work = self.stub.GetRound(pb.GetRoundRequest(), metadata=auth, timeout=CALL_TIMEOUT_S)
        if work.state != pb.ROUND_STATE_TRAIN or work.round != round_index:
            return  # not assigned, submitted already (in a case), or the round moved on
        ids = list(dict.fromkeys(work.sequence_ids))  # each once, as the client asks
        try:
            with _step(f"{member.client_id}'s FetchSequences in round {round_index}"):
                got = [s.id for s in self.stub.FetchSequences(
                    pb.FetchSequencesRequest(ids=ids), metadata=auth, timeout=CALL_TIMEOUT_S)]
            if got != ids:
                raise _Unserved(f"{member.client_id} asked for sequences {ids} and got {got}")
            with _step(f"{member.client_id}'s SubmitResult in round {round_index}"):
                self.stub.SubmitResult(iter(valid_submission(self.target, member.client_id)),
                                       metadata=auth, timeout=CALL_TIMEOUT_S)
        except _Unserved:
            # The round's deadline passed on the close worker after GetRound answered, and
            # its work was handed out anew: the member asks again, as the client does, and
            # the honest round goes on. Any other refusal is the run failing the member.
            held = self.target.assignment_for(member.client_id)
            if held is not None and held.assignment_id == work.assignment_id:
                raise

    def step(self, data: st.DataObject) -> None:
        """One case; after every ``round_every``-th, an honest round."""
        with self.serving():
            self.case(data)
            if self.report.tried % self.round_every == 0:
                self.honest_round()

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """Where honest members call: a failure is a crash, listed with the cases since the
        last honest round (one of them was accepted and broke the run), and fuzzing stops."""
        try:
            yield
        except _Unserved as err:
            cases = "; ".join(what if payload is None else
                              f"{what}, request {_shown(rpc, payload)}"
                              for what, rpc, payload in self.since_round)
            self.report.crashes.append(f"the run stopped serving honest members ({err}) after "
                                       f"{len(self.since_round)} case(s): {cases}")
            self.stopped = True

    def case(self, data: st.DataObject) -> None:
        # Which RPC, made how, goes round every pair in turn, so each is tried whatever the
        # draws: drawn, they depend on the live server's answers, and a change anywhere once
        # left results off the run's layout untried.
        rpc, how = PAIRS[sum(self.report.hows.values()) % len(PAIRS)]
        self.report.hows[rpc, how] += 1
        self.honest_members()
        live = {client: token for client, token in self.tokens.items()
                if self.target.sessions.client_of(token) is not None}
        tokens = sorted(live.values())
        # members with work in the open round: what they send is taken, so it can do harm
        working = sorted(token for client, token in live.items()
                         if self.target.assignment_for(client) is not None)
        # Draws never depend on the server's state (hypothesis replays them): an index, not a
        # choice among however many tokens there are.
        # a result's layout is read only in a submission of work in the open round
        auth = data.draw(st.sampled_from(["working"] if how == "off layout" else [
            "none", "forged", "garbage", "revoked", "live", "working"]), label="auth")
        garbage, index = data.draw(ASCII_TOKEN), data.draw(INDEX)
        token = {"none": None, "forged": f"{tokens[0].rpartition('.')[0]}.forged",
                 "garbage": garbage,
                 "revoked": self.revoked[-1] if self.revoked else "client-0.revoked",
                 "live": tokens[index % len(tokens)],
                 "working": (working or tokens)[index % len(working or tokens)]}[auth]
        metadata = session_metadata(token) if token else ()
        client_id = (token or "").rpartition(".")[0]
        payload = self.request(data, rpc, how, client_id)
        seen_errors = len(self.errors.records)
        # what earlier accepted calls set off (a close, a relay's hand-in) is over first
        self.target.settle(lambda: len(self.errors.records) > seen_errors)
        before = self.target.snapshot()
        code, reply = _invoke(self.channel, rpc, payload, metadata)
        what = self.record(rpc, auth, code, reply, before, seen_errors)
        self.since_round.append((what, rpc, payload if code == "OK" else None))
        if code == "OK" and rpc == "Join":
            joined = pb.JoinReply.FromString(reply)
            self.tokens[joined.client_id] = joined.session_token
        if code == "OK" and rpc == "Leave":
            self.revoked.append(token)

    def request(self, data: st.DataObject, rpc: str, how: str, client_id: str
                ) -> bytes | list[bytes]:
        """Raw request bytes (a list of them for SubmitResult), made ``how``."""
        if rpc == "SubmitResult":
            valid = valid_submission(self.target, client_id or "client-0")
            if how == "random":
                messages = data.draw(requests(rpc, self.names, [client_id]))
                return [m.SerializeToString() for m in messages]
            if how == "off layout":
                i = data.draw(st.integers(1, len(valid) - 1), label="result")
                valid[i] = data.draw(off_layout(valid[i]))
                return [m.SerializeToString() for m in valid]
            # the header (what the client claims of its work) half the time
            i = data.draw(st.just(0) | st.integers(0, len(valid) - 1), label="message")
            blobs = [m.SerializeToString() for m in valid]
            if how == "one field":
                path = data.draw(st.sampled_from(list(_field_paths(valid[i]))), label="field")
                other = (pb.SubmitMessage(header=data.draw(headers([client_id])))
                         if path.startswith("header") else
                         pb.SubmitMessage(result=data.draw(sparse_results(self.names))))
                blobs[i] = _with_field(valid[i], other, path).SerializeToString()
            elif how == "one number":
                blobs[i] = data.draw(edge_numbers(valid[i])).SerializeToString()
            else:
                blobs[i] = data.draw(mutated(blobs[i]))
            return blobs
        valid = {"Join": join_request(self.target.server, "mutant"),
                 "Heartbeat": pb.HeartbeatRequest(round=0, tokens_per_second=1000.0),
                 "FetchSequences": pb.FetchSequencesRequest(ids=[0, 1, 2]),
                 "GetUpdates": pb.GetUpdatesRequest(since_round=0),
                 "DownloadCheckpoint": pb.DownloadCheckpointRequest(
                     path=f"round-0/{MANIFEST_NAME}"),
                 "Leave": pb.LeaveRequest(reason="done")}.get(rpc)
        if how == "random" or valid is None:
            message = data.draw(requests(rpc, self.names, [client_id]))
            return (data.draw(mutated(message.SerializeToString())) if how == "mutated"
                    else message.SerializeToString())
        if how == "one number" and _number_paths(valid):
            return data.draw(edge_numbers(valid)).SerializeToString()
        if how in ("one field", "one number"):  # the valid request, one field from a random one
            other = data.draw(requests(rpc, self.names, [client_id]))
            path = data.draw(st.sampled_from(list(_field_paths(valid))), label="field")
            return _with_field(valid, other, path).SerializeToString()
        return data.draw(mutated(valid.SerializeToString()))

    def record(self, rpc: str, auth: str, code: str, reply: bytes | None,
               before: dict[str, str], seen_errors: int) -> str:
        """Count the call and check what it did; what happened, in words."""
        report = self.report
        report.tried += 1
        report.codes[rpc, code] += 1
        what = f"{rpc} (session: {auth}) → {code}: {(reply or b'')[:300]!r}"
        if code in ("UNKNOWN", "INTERNAL", "DEADLINE_EXCEEDED"):
            report.crashes.append(what)
        try:
            status = self.health.Check(health_pb2.HealthCheckRequest(service=COORDINATOR_SERVICE),
                                       timeout=10).status
        except grpc.RpcError as err:
            status = err.code().name
        if status != health_pb2.HealthCheckResponse.SERVING:
            report.crashes.append(f"health check {status} after {what}")
        report.crashes.extend(f"logged after {what}: {line}"
                              for line in self.errors.records[seen_errors:])
        if code == "OK":
            report.accepted += 1
            return what
        report.rejected += 1
        report.check_unchanged(what, before, self.target.snapshot())
        return what


def _wait_for_close(c: Coordinator, failed: Callable[[], bool]) -> None:
    """Until the close worker has closed every round that is ready (an honest submission
    that completes a round returns before its close, which runs on the worker), or
    ``failed()``: an error was logged, a failed close among them, which the worker retries
    in vain."""
    give_up = time.monotonic() + CALL_TIMEOUT_S
    while time.monotonic() < give_up and not failed():
        with c._lock:
            busy = c.pipeline.closing is not None or c.pipeline.ready(c.clock()) is not None
        if not busy:
            return
        time.sleep(0.01)


def _shown(rpc: str, payload: bytes | list[bytes], limit: int = 200) -> str:
    """A request as protobuf text, each message of a stream cut to ``limit`` characters; its
    bytes where they do not parse."""
    message = getattr(pb, METHODS[rpc].input_type.name)
    shown = []
    for blob in payload if isinstance(payload, list) else [payload]:
        try:
            text = text_format.MessageToString(message.FromString(blob), as_one_line=True)
        except DecodeError:
            text = f"(does not parse) {blob!r}"
        shown.append(f"{{{text[:limit]}}}")
    return " ".join(shown)


def difference(before: str, after: str, context: int = 60) -> str:
    """Where two snapshots part first: the text around it, before → after."""
    i = next((i for i, (a, b) in enumerate(zip(before, after, strict=False)) if a != b),
             min(len(before), len(after)))
    start = max(i - context, 0)
    return f"{before[start:i + context]!r} → {after[start:i + context]!r}"


class _Stop(Exception):
    """The fuzzing time is spent, or the run stopped serving honest members."""


@st.composite
def edge_numbers(draw: st.DrawFn, message: Message) -> Message:
    """``message`` with one of its numbers (nested ones too) at an edge of its type."""
    numbers = _number_paths(message)
    path = draw(st.sampled_from(list(numbers)), label="number")
    out = type(message)()
    out.CopyFrom(message)
    target, name = _parent(out, path)
    setattr(target, name, draw(st.sampled_from(EDGES[numbers[path].cpp_type])))
    return out


def _field_paths(message: Message) -> dict[str, FieldDescriptor]:
    """Every field of ``message`` by dotted path, those inside the message fields it holds
    too: one bad number inside a valid request (a Join's capabilities.tokens_per_second, a
    submission's header.train_seconds) is what a checked field lets through unnoticed."""
    paths = {}
    for f in message.DESCRIPTOR.fields:
        paths[f.name] = f
        if f.message_type is not None and not f.is_repeated and message.HasField(f.name):
            paths |= {f"{f.name}.{path}": inner
                      for path, inner in _field_paths(getattr(message, f.name)).items()}
    return paths


def _number_paths(message: Message) -> dict[str, FieldDescriptor]:
    return {path: f for path, f in _field_paths(message).items()
            if not f.is_repeated and f.cpp_type in EDGES}


def _parent(message: Message, path: str) -> tuple[Message, str]:
    """The message that holds the field at dotted ``path``, and the field's name."""
    *outer, name = path.split(".")
    for part in outer:
        message = getattr(message, part)
    return message, name


def _with_field(message: Message, other: Message, path: str) -> Message:
    """A copy of ``message`` with the field at dotted ``path`` as ``other`` has it (set or
    not)."""
    out = type(message)()
    out.CopyFrom(message)
    (target, name), (source, _) = _parent(out, path), _parent(other, path)
    donor = type(source)()
    donor.CopyFrom(source)
    for f, _ in source.ListFields():
        if f.name != name:
            donor.ClearField(f.name)
    target.ClearField(name)
    target.MergeFrom(donor)
    return out


def fuzz(target: Target, *, examples: int, seconds: float, seed: int = 0,
         round_every: int = ROUND_EVERY) -> FuzzReport:
    """Up to ``examples`` cases against ``target``, stopping after ``seconds``, with an honest
    round before the first, after every ``round_every`` cases and after the last; the same
    cases for a seed. The target keeps the fuzzer's clocks (``Target.freeze``)."""
    report = FuzzReport()
    stop_at = time.monotonic() + seconds
    with grpc.insecure_channel(f"127.0.0.1:{target.port}", options=GRPC_OPTIONS) as channel:
        fuzzer = RpcFuzzer(target, channel, report, round_every=round_every)
        with watching(report, fuzzer.errors):
            with fuzzer.serving():  # a fresh run serves honest members: no case is to blame
                fuzzer.honest_round()
            run_cases(fuzzer.step, report, examples=examples, stop_at=stop_at, seed=seed,
                      stopped=lambda: fuzzer.stopped)
            if fuzzer.since_round and not fuzzer.stopped:
                with fuzzer.serving():  # the cases after the last honest round
                    fuzzer.honest_round()
            fuzzer.leave()
    return report


@contextlib.contextmanager
def watching(report: FuzzReport, errors: ErrorLog) -> Iterator[None]:
    """Errors logged meanwhile go to ``errors`` (uvicorn's among them: its logger keeps its
    records from the root logger), exceptions that end a thread to ``report.crashes``."""
    hook = threading.excepthook

    def on_thread_error(args: threading.ExceptHookArgs) -> None:
        report.crashes.append(f"thread {args.thread.name if args.thread else '?'}: "
                              f"{args.exc_type.__name__}: {args.exc_value}")
        hook(args)

    loggers = [logging.getLogger(), logging.getLogger("uvicorn")]
    for logger in loggers:
        logger.addHandler(errors)
    threading.excepthook = on_thread_error
    try:
        yield
    finally:
        threading.excepthook = hook
        for logger in loggers:
            logger.removeHandler(errors)


def run_cases(step: Callable[[st.DataObject], None], report: FuzzReport, *, examples: int,
              stop_at: float, seed: int, stopped: Callable[[], bool]) -> None:
    """``step`` on up to ``examples`` cases (counted in ``report.tried``) that hypothesis draws
    from ``seed``, until ``time.monotonic()`` passes ``stop_at`` or ``stopped()``."""
    def cases_for(run_seed: int, count: int):
        @settings(max_examples=count, deadline=None, database=None,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @hypothesis_seed(run_seed)
        @given(st.data())
        def cases(data: st.DataObject) -> None:
            if stopped() or time.monotonic() > stop_at:
                raise _Stop  # ends hypothesis's loop; returning would change the draws
            step(data)
        return cases

    with contextlib.suppress(_Stop):
        run_seed = seed
        while report.tried < examples and not stopped():
            try:
                cases_for(run_seed, examples - report.tried)()
            except FlakyStrategyDefinition:
                # the draws depend on the live server (members, rounds), which hypothesis's
                # replay bookkeeping cannot know: go on with the next seed
                report.reseeded += 1
                run_seed += 1
                continue
            break


def fuzzed(target: str, directory: Path, *, examples: int, seconds: float, seed: int,
           round_every: int) -> FuzzReport:
    """Fuzz ``target`` ("root", "relay" or "http") with a run in ``directory``."""
    budget = {"examples": examples, "seconds": seconds, "seed": seed}
    if target == "relay":
        with fuzz_relay(directory) as relay:
            return fuzz(relay, round_every=round_every, **budget)
    with fuzz_server(directory) as server:
        if target == "http":
            from fuzz_http import fuzz_http  # it imports this module
            return fuzz_http(server, **budget)
        return fuzz(RootTarget(server), round_every=round_every, **budget)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", choices=["root", "relay", "http"], default="root",
                        help="the root's RPCs, a relay's in front of it, or the root's HTTP side")
    parser.add_argument("--examples", type=int, default=2000, help="most cases to try")
    parser.add_argument("--seconds", type=float, default=120.0, help="stop after this long")
    parser.add_argument("--seed", type=int, default=0, help="same seed, same cases")
    parser.add_argument("--round-every", type=int, default=ROUND_EVERY,
                        help="cases between the honest members' rounds (RPC targets)")
    parser.add_argument("--dir", type=Path, default=None,
                        help="run directory to fuzz in (default: a temporary one)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="fuzz-rpc-") as tmp:
        started = time.monotonic()
        report = fuzzed(args.target, args.dir or Path(tmp), examples=args.examples,
                        seconds=args.seconds, seed=args.seed, round_every=args.round_every)
        elapsed = time.monotonic() - started
    print(report.table())
    print(f"\n{report.tried} cases in {elapsed:.0f} s: {report.accepted} accepted, "
          f"{report.rejected} rejected, {len(report.crashes)} crashes, "
          f"{len(report.state_changes)} rejected calls that changed state, "
          f"{report.rounds} honest rounds between them"
          + (f" ({report.reseeded} reseeds)" if report.reseeded else ""))
    for line in [*report.crashes, *report.state_changes]:
        print(f"  {line}")
    return 1 if report.crashes or report.state_changes else 0


if __name__ == "__main__":
    sys.exit(main())
