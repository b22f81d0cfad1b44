"""The client's end of the coordinator protocol (protocol/matformer/v1/coordinator.proto).

    connection = Connection("127.0.0.1:7070")            # tls_ca=Path(...) for TLS
    member = connection.join(name=..., join_token=..., ...)  # remembers the session token
    work = connection.get_round()                        # Train | Wait | Finished
    connection.fetch_sequences(work.sequence_ids); connection.submit(work, ...)
    connection.updates(since_round, tier); connection.download(path, dest, sha256)
    connection.published(since_round, tier)              # those rounds' headers alone
    with connection.keep_alive(lambda: work.round): ...  # heartbeats while busy
    connection.leave(reason)

This module is the transport edge: it speaks protobuf and gRPC, and what it hands on are
domain types (``Membership``, ``Train``, ``RoundUpdate``, ...) and domain errors
(``client.errors``: ``RoundOver``, ``SessionEnded``, ``Excluded``, ...). Nothing past it
sees a status code. A call the network lost (``UNAVAILABLE``: the coordinator restarting, a
dropped link) is retried with exponential backoff and jitter for up to ``patience_s``; any
other status is the coordinator's answer and surfaces at once.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, TypeVar

import grpc
import torch

from matformer.client.errors import (
    DamagedOnServer,
    Excluded,
    NameTaken,
    NotServed,
    Refused,
    RoundOver,
    SessionEnded,
    Unreachable,
    UpdatesPruned,
)
from matformer.client.heartbeat import Heartbeat
from matformer.client.progress import Planned
from matformer.modeling.compression import RoundUpdate, SparseResult
from matformer.protocol.auth import session_metadata
from matformer.protocol.channel import CLIENT_OPTIONS, at_port, open_channel
from matformer.protocol.files import receive_file
from matformer.protocol.link import metered
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.protocol.settings import RunSettings, decode_settings
from matformer.protocol.submission import submission_messages
from matformer.protocol.tensors import decode_tensor
from matformer.protocol.updates import RoundHeader, read_headers, read_updates

T = TypeVar("T")
RETRY_FIRST_S = 0.2  # first backoff; doubles per attempt up to RETRY_MAX_S, with jitter
RETRY_MAX_S = 5.0
HEARTBEAT_DEADLINE_S = 10.0  # a heartbeat call unanswered this long counts as unanswered
LEAVE_S = 5.0  # a Leave's deadline, and how long it is retried: Ctrl-C never waits longer
DOOR_RETRY_S = 60.0  # beats at the coordinator's port this long after its heartbeat port failed

Code = grpc.StatusCode
# What a status means, call by call: the coordinator's answers the client acts on. Any other
# status is a plain ``Refused``.
SESSION = {Code.UNAUTHENTICATED: SessionEnded, Code.PERMISSION_DENIED: Excluded}
ROUND_OVER = {Code.INVALID_ARGUMENT: RoundOver, Code.FAILED_PRECONDITION: RoundOver}
MEANINGS: dict[str, Mapping[Code, type[Refused]]] = {
    # a bad join token is UNAUTHENTICATED too, and that is no session ending
    "Join": {Code.ALREADY_EXISTS: NameTaken, Code.PERMISSION_DENIED: Excluded},
    "Heartbeat": SESSION,
    "GetRound": SESSION,
    "FetchSequences": SESSION | ROUND_OVER,
    "SubmitResult": SESSION | ROUND_OVER,
    "GetUpdates": SESSION | {Code.OUT_OF_RANGE: UpdatesPruned},
    "GetCheckpoint": SESSION,
    "DownloadCheckpoint": SESSION | {Code.NOT_FOUND: NotServed, Code.DATA_LOSS: DamagedOnServer},
    "Leave": SESSION,
}
ADVICE = {
    Excluded: "Ask the run's operator why; this client cannot rejoin the run.",
    DamagedOnServer: "Nothing was kept; tell the run's operator, whose checkpoint on disk is "
                     "damaged, then run the client again.",
}


# -- what the coordinator says, as the client uses it ---------------------------------------


@dataclass(frozen=True, slots=True)
class PublishedCheckpoint:
    """A checkpoint the coordinator wrote after ``round`` rounds: its folder in the run's
    checkpoint directory. Replay the update log from ``round`` on top of it."""

    round: int
    folder: str

    @classmethod
    def from_proto(cls, ref: pb.CheckpointRef) -> PublishedCheckpoint:
        return cls(round=ref.round, folder=ref.manifest_path.rpartition("/")[0])


@dataclass(frozen=True, slots=True)
class Membership:
    """What joining gave: who this client is in the run and what it trains."""

    client_id: str
    tier: int
    ffn_width: int  # FFN neurons at that tier
    tier_reason: str  # why this tier, in words
    round: int  # the coordinator's current round
    checkpoint: PublishedCheckpoint | None  # None: none yet, the run's initial weights
    settings: RunSettings
    schema_hash: str  # canonical schema hash of the run's model
    planned: Planned  # how far the run goes


@dataclass(frozen=True, slots=True)
class Train:
    """Train ``sequence_ids`` at ``tier`` for ``round`` and submit, quoting ``assignment_id``."""

    round: int
    tier: int
    sequence_ids: tuple[int, ...]
    assignment_id: str
    run_tokens: int = 0  # the run's tokens in completed rounds when this was handed out


@dataclass(frozen=True, slots=True)
class Wait:
    """No work for this client now; ask again after ``retry_after_s``."""

    round: int
    retry_after_s: float


@dataclass(frozen=True, slots=True)
class Finished:
    """The run is over after ``round`` rounds and ``run_tokens`` tokens."""

    round: int
    run_tokens: int = 0


class Submitted(NamedTuple):
    """What a submission came to: results accepted, bytes sent, and the client's assignments
    not yet submitted (overlapped rounds hand the next ones out with the answer)."""

    accepted: int
    sent: int
    assignments: list[Train]


def _work(reply: pb.RoundAssignment) -> Train | Wait | Finished:
    if reply.state == pb.ROUND_STATE_FINISHED:
        return Finished(round=reply.round, run_tokens=reply.run_tokens)
    if reply.state == pb.ROUND_STATE_TRAIN:
        return Train(round=reply.round, tier=reply.tier, sequence_ids=tuple(reply.sequence_ids),
                     assignment_id=reply.assignment_id, run_tokens=reply.run_tokens)
    return Wait(round=reply.round, retry_after_s=reply.retry_after_seconds)


# -- the connection --------------------------------------------------------------------------


class Connection:
    def __init__(self, address: str, *, tls_ca: Path | None = None, latency_s: float = 0.0,
                 bandwidth_mbit: float = 0.0, patience_s: float = 60.0,
                 log: Callable[[str], None] = lambda line: None) -> None:
        """``latency_s`` delays every call by that much and ``bandwidth_mbit`` limits each
        direction (local-testnet's simulated WAN; 0: no limit)."""
        self.channel = open_channel(address, tls_ca=tls_ca)
        # every message counted each way (``meter``), and held to bandwidth_mbit if set
        self.channel, self.meter = metered(self.channel, mbit_per_s=bandwidth_mbit)
        self.address = address
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.tls_ca = tls_ca
        # where heartbeats go when the coordinator answers them in a process of their own
        # (JoinReply.heartbeat_port); None: to ``stub``, with every other call
        self.beat_stub: pb_grpc.CoordinatorStub | None = None
        self._beat_channel: grpc.Channel | None = None
        self.door_again_at = 0.0  # after the door failed: beats go to ``stub`` until then
        self.latency_s = latency_s
        self.patience_s = patience_s
        self.log = log
        self.metadata: tuple[tuple[str, str], ...] = ()  # the session, once joined
        self.session_token = ""
        self.heartbeat_s = 0.0  # the run's heartbeat interval, once joined
        self.heartbeats: Heartbeat | None = None  # the keep_alive thread beating now, if any
        self.heartbeat_gap_s = 0.0  # the longest time between two heartbeats it sent
        self.call_seconds: Counter[str] = Counter()  # RPC name → seconds in its calls
        self.calls: Counter[str] = Counter()  # RPC name → calls made (each try counts)
        self.update_bytes = 0  # received in GetUpdates messages
        self._unanswered_since: float | None = None  # the outage being retried, said once
        self._outage = threading.Lock()

    @property
    def joined(self) -> bool:
        return bool(self.metadata)

    def close(self) -> None:
        self._beat_at(0)
        self.channel.close()

    def _beat_at(self, port: int) -> None:
        """Send heartbeats to ``port`` of the coordinator's host (0: to its address)."""
        if self._beat_channel is not None:
            self._beat_channel.close()
        self._beat_channel = self.beat_stub = None
        self.door_again_at, self._door_port = 0.0, port
        if port:
            # a subchannel of its own: a shared one would keep the backoff of a door that
            # failed, and a new channel to a door back on its port would be refused at once
            self._beat_channel = open_channel(
                at_port(self.address, port), tls_ca=self.tls_ca,
                options=(*CLIENT_OPTIONS, ("grpc.use_local_subchannel_pool", 1)))
            self.beat_stub = pb_grpc.CoordinatorStub(self._beat_channel)

    # -- the RPCs -----------------------------------------------------------------------

    def join(self, *, name: str, run_id: str, join_token: str, device_kind: str,
             device_name: str, memory_bytes: int, load_strategy: str, microbatch_tokens: int,
             tier: int | None, previous_session: str | None = None) -> Membership:
        """Join the run as ``name``, asking for ``tier`` or smaller (None: any).
        ``previous_session`` (the token this client held before a restart) proves it is the
        member of that session, so it takes its name back without waiting."""
        capabilities = pb.Capabilities(
            device_kind=device_kind, device_name=device_name, memory_bytes=memory_bytes,
            load_strategy=load_strategy, microbatch_tokens=microbatch_tokens,
            requested_tier=tier)  # None leaves it unset: any tier
        request = pb.JoinRequest(run_id=run_id, join_token=join_token, client_name=name,
                                 capabilities=capabilities)
        metadata = session_metadata(previous_session) if previous_session else ()
        reply = self._call("Join", lambda: self.stub.Join(request, metadata=metadata))
        self.session_token = reply.session_token
        self.metadata = session_metadata(reply.session_token)
        self.heartbeat_s = reply.settings.heartbeat_seconds
        self._beat_at(reply.heartbeat_port)
        checkpoint = (PublishedCheckpoint.from_proto(reply.checkpoint)
                      if reply.HasField("checkpoint") else None)
        return Membership(client_id=reply.client_id, tier=reply.tier,
                          ffn_width=reply.ffn_width, tier_reason=reply.tier_reason,
                          round=reply.round, checkpoint=checkpoint,
                          settings=decode_settings(reply.settings),
                          schema_hash=reply.schema_hash, planned=Planned(
                              reply.rounds_planned or None, reply.tokens_planned or None))

    def heartbeat(self, round_index: int, tokens_per_second: float | None = None, *,
                  patience_s: float | None = None) -> None:
        request = pb.HeartbeatRequest(round=round_index, tokens_per_second=tokens_per_second)
        # a deadline of two beats: on a link gone half-open (no FIN, no RST) the call would
        # hang until the link returns, and the member would not notice the outage
        deadline_s = 2 * (self.heartbeat_s or HEARTBEAT_DEADLINE_S / 2)

        def beat() -> pb.HeartbeatReply:
            if self.door_again_at and time.monotonic() >= self.door_again_at:
                failed_at = self.door_again_at
                self._beat_at(self._door_port)  # a new connection: the old one backs off
                self.door_again_at = failed_at
            stub = self.beat_stub
            if stub is not None and time.monotonic() >= self.door_again_at:
                try:
                    reply = stub.Heartbeat(request, metadata=self.metadata, timeout=deadline_s)
                except grpc.RpcError as err:
                    if err.code() not in (Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED):
                        raise
                    # its port is out of reach (a firewall; the coordinator restarting): the
                    # coordinator's own answers beats too, and the door is tried again later
                    if not self.door_again_at:
                        self.log(f"the coordinator's heartbeat port does not answer "
                                 f"({err.details()}); heartbeats go to {self.address} "
                                 f"instead, and to that port again every {DOOR_RETRY_S:g} s")
                    self.door_again_at = time.monotonic() + DOOR_RETRY_S
                else:
                    self.door_again_at = 0.0  # answered: the door is back
                    return reply
            return self.stub.Heartbeat(request, metadata=self.metadata, timeout=deadline_s)

        self._call("Heartbeat", beat, patience_s=patience_s,
                   retried=(Code.UNAVAILABLE, Code.DEADLINE_EXCEEDED))

    def keep_alive(self, round_index: Callable[[], int]) -> Heartbeat:
        """Heartbeats for ``round_index()`` while the ``with`` block runs (inside another
        ``keep_alive``: the outer one's)."""
        return Heartbeat(self, round_index)

    def get_round(self, after: int | None = None) -> Train | Wait | Finished:
        """The oldest assignment not yet submitted (in a round after ``after``)."""
        request = pb.GetRoundRequest() if after is None else pb.GetRoundRequest(after_round=after)
        return _work(self._call("GetRound", lambda: self.stub.GetRound(
            request, metadata=self.metadata)))

    def fetch_sequences(self, ids: Sequence[int]) -> list[torch.Tensor]:
        """The token ids of ``ids``, in that order, as 1-D int64 tensors. Each id is asked for
        once: an assignment can hold one twice (data shorter than a round's budget, or an id
        handed back meeting its next epoch), and the coordinator refuses a repeat."""

        def fetch() -> list[torch.Tensor]:
            distinct = list(dict.fromkeys(ids))
            stream = self.stub.FetchSequences(pb.FetchSequencesRequest(ids=distinct),
                                              metadata=self.metadata)
            got = {m.id: decode_tensor(m.tokens, f"sequence {m.id}").long() for m in stream}
            missing = [i for i in ids if i not in got]
            if missing:
                raise Refused("FetchSequences", "DATA_LOSS",
                              f"sequences {missing[:5]} did not arrive.")
            return [got[i] for i in ids]

        return self._call("FetchSequences", fetch)

    def submit(self, work: Train, *, client_id: str, tokens: int, loss: float,
               train_seconds: float, results: Sequence[SparseResult]) -> Submitted:
        """Stream the results of ``work``."""
        header = pb.SubmitHeader(round=work.round, client_id=client_id, tokens=tokens,
                                 loss=loss, train_seconds=train_seconds,
                                 assignment_id=work.assignment_id)
        sent = 0

        def counted() -> Iterator[pb.SubmitMessage]:
            nonlocal sent
            sent = 0
            for message in submission_messages(header, results):
                sent += message.ByteSize()
                yield message

        reply = self._call("SubmitResult", lambda: self.stub.SubmitResult(
            counted(), metadata=self.metadata))
        handed = [w for w in map(_work, reply.assignments) if isinstance(w, Train)]
        return Submitted(reply.accepted, sent, handed)

    def updates(self, since_round: int, tier: int, *, wait_s: float = 0.0
                ) -> list[RoundUpdate]:
        """The logged round updates from ``since_round`` to the last completed round, cut to
        ``tier``, the one this client's replica holds; ``update_bytes`` counts their messages
        (before gRPC's gzip on the wire). ``wait_s``: when round ``since_round`` has not
        closed yet, the coordinator waits up to this long for it before answering."""

        def counted(stream: Iterator[pb.UpdateMessage]) -> Iterator[pb.UpdateMessage]:
            for message in stream:
                self.update_bytes += message.ByteSize()
                yield message

        return self._call("GetUpdates", lambda: list(read_updates(counted(self.stub.GetUpdates(
            pb.GetUpdatesRequest(since_round=since_round, wait_seconds=wait_s, tier=tier),
            metadata=self.metadata)), tier)))

    def published(self, since_round: int, tier: int, *, wait_s: float = 0.0
                  ) -> list[RoundHeader]:
        """What the coordinator published of the rounds ``updates`` would give, their
        headers alone (weight hash, rule, parameter updates): about 100 bytes a round."""
        return self._call("GetUpdates", lambda: list(read_headers(self.stub.GetUpdates(
            pb.GetUpdatesRequest(since_round=since_round, wait_seconds=wait_s, tier=tier,
                                 headers_only=True), metadata=self.metadata))))

    def latest_checkpoint(self) -> PublishedCheckpoint:
        """The coordinator's latest checkpoint."""
        return PublishedCheckpoint.from_proto(self._call("GetCheckpoint", lambda: (
            self.stub.GetCheckpoint(pb.GetCheckpointRequest(), metadata=self.metadata))))

    def download(self, path: str, dest: Path, sha256: str | None = None) -> str:
        """A file of the run's checkpoint directory to ``dest`` (atomically); its sha256."""
        return self._call("DownloadCheckpoint", lambda: receive_file(self.stub.DownloadCheckpoint(
            pb.DownloadCheckpointRequest(path=path), metadata=self.metadata), dest, sha256))

    def leave(self, reason: str) -> None:
        self._call("Leave", lambda: self.stub.Leave(
            pb.LeaveRequest(reason=reason), metadata=self.metadata, timeout=LEAVE_S),
            patience_s=LEAVE_S)

    # -- retries and the meaning of a status --------------------------------------------

    def _call(self, name: str, action: Callable[[], T], *, patience_s: float | None = None,
              retried: tuple[Code, ...] = (Code.UNAVAILABLE,)) -> T:
        patience_s = self.patience_s if patience_s is None else patience_s
        give_up = time.monotonic() + patience_s
        backoff = RETRY_FIRST_S
        while True:
            start = time.perf_counter()
            if self.latency_s:
                time.sleep(self.latency_s)
            self.calls[name] += 1
            try:
                answer = action()
                self._answered()
                return answer
            except grpc.RpcError as err:
                code = err.code()
                if code not in retried:
                    self._answered()
                    raise _refusal(name, code, err.details() or "") from None
                self._unanswered(name, err.details(), patience_s)
                if time.monotonic() + backoff > give_up:
                    raise Unreachable(
                        f"the coordinator at {self.address} did not answer {name} for "
                        f"{patience_s:.0f} s ({err.details()}); check --server and that "
                        "matformer-server is running.") from None
            finally:
                self.call_seconds[name] += time.perf_counter() - start
            time.sleep(backoff * random.uniform(0.5, 1.5))
            backoff = min(backoff * 2, RETRY_MAX_S)

    def _unanswered(self, name: str, details: str | None, patience_s: float) -> None:
        """Say the first call an outage leaves unanswered, at once (the retries are quiet)."""
        with self._outage:
            if self._unanswered_since is not None:
                return
            self._unanswered_since = time.monotonic()
        self.log(f"the coordinator at {self.address} does not answer {name} ({details}); "
                 f"retrying for up to {patience_s:.0f} s")

    def _answered(self) -> None:
        """After an outage was said: that it is over."""
        with self._outage:
            since, self._unanswered_since = self._unanswered_since, None
        if since is not None:
            self.log(f"the coordinator at {self.address} answers again, after "
                     f"{time.monotonic() - since:.1f} s")


def _refusal(call: str, code: Code, details: str) -> Refused:
    kind = MEANINGS[call].get(code, Refused)
    advice = ADVICE.get(kind)
    return kind(call, code.name, f"{details} {advice}" if advice else details)
