"""The Coordinator gRPC service (protocol/matformer/v1/coordinator.proto): one servicer over
the run's member API (server/member_api.py), which the root's ``Coordinator`` offers and a
relay (``relay.relay.Relay``) offers near its members.

    servicer = CoordinatorService(coordinator, limits)   # or CoordinatorService(relay, limits)
    pb_grpc.add_CoordinatorServicer_to_server(servicer, grpc_server)

This is the transport edge: messages become the run's records here and back, and every
error raised on purpose becomes a status with ``context.abort(err.code, str(err))``:
``ProtocolError`` and ``CompressionError`` (malformed messages: INVALID_ARGUMENT),
``CoordinatorError`` / ``TierAssignmentError`` (each with its own code), and what a relay's
root answered (``relay.upstream.UpstreamError``, passed on with the root's status). A
rejected submission leaves the round's aggregate untouched: the run keeps all of a
submission or none of it, and counts a refused one against the client (``rejected``).
``Join`` presents the run's join token (or a client key); every other RPC the session token
``Join`` issued (``authenticate``: UNAUTHENTICATED when unknown or expired,
PERMISSION_DENIED once the client is excluded). Every call holds one of the member's call
slots, and a stream one of its stream slots (server/call_slots.py; the gate in front of
this service takes the call slot): RESOURCE_EXHAUSTED beyond a member's share, UNAVAILABLE
when every shared stream slot is taken (a member with work in an open round always has one
stream of its own), DEADLINE_EXCEEDED for a stream that waited on its peer too long. A
submission's header is checked before any of its results is read, and each result against
its layout (protocol/sparse.py) as it is decoded.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import NoReturn, TypeVar

import grpc
from google.protobuf.message import Message

from matformer.modeling.errors import CompressionError
from matformer.protocol.auth import SESSION_METADATA_KEY, presented_session
from matformer.protocol.errors import MalformedStream, ProtocolError
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.protocol.records import decode_header, encode_checkpoint
from matformer.protocol.settings import encode_settings
from matformer.protocol.submission import (
    decode_screened,
    read_submission,
    screen_partials,
    screen_results,
)
from matformer.protocol.tensors import encode_tensor
from matformer.protocol.updates import carries_values
from matformer.server.call_slots import CallLimits, CallSlots, Watch, end_call
from matformer.server.errors import (
    BadResult,
    CallRefused,
    CoordinatorError,
    FileNotServed,
    RepeatedSequenceIds,
    ServedFileDamaged,
    StaleRound,
    SubmissionTooLarge,
    TierAssignmentError,
    UnknownSequence,
    UpstreamError,
)
from matformer.server.member_api import JoinAsk, MemberAPI, Waiting
from matformer.server.rounds import RoundAssignment
from matformer.server.tiers import Capabilities

MAX_WAIT_S = 30.0  # the longest GetUpdates holds a call waiting for a round to close
DECODERS = min(4, os.cpu_count() or 1)  # submissions decoded at once (CoordinatorService)

T = TypeVar("T")
M = TypeVar("M", bound=Message)
_REFUSED = (ProtocolError, CompressionError, CoordinatorError, TierAssignmentError,
            CallRefused, RepeatedSequenceIds, UnknownSequence, UpstreamError)


class CoordinatorService(pb_grpc.CoordinatorServicer):
    """The one servicer of the member RPCs, for the root and for a relay alike."""

    def __init__(self, coordinator: MemberAPI, limits: CallLimits) -> None:
        self.coordinator = coordinator  # the root's, or a relay standing in for it
        # a member with work in the open round always has a stream of its own
        self.slots = CallSlots(limits, assigned=lambda client_id: bool(
            coordinator.pending(client_id)))
        # Submissions are received by as many threads as arrive, but decoded and checked
        # by at most DECODERS at a time: a thousand uploads decoding at once would each
        # take the GIL in turn, and a heartbeat would wait behind all of them.
        self._decoding = threading.BoundedSemaphore(DECODERS)
        self.heartbeat_port = 0  # where a member sends its beats, when not here (Join tells)

    # -- join and membership ------------------------------------------------------------

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        c = self.coordinator
        # a restarted client presents the session it had, to take its name back at once
        previous = dict(context.invocation_metadata()).get(SESSION_METADATA_KEY)
        ask = JoinAsk(capabilities=capabilities_of(request, c.sequence_length),
                      join_token=request.join_token, run_id=request.run_id,
                      schema_hash=(request.schema.canonical_hash
                                   if request.HasField("schema") else None),
                      previous_session=previous)
        joined = _call(context, lambda: c.admit(ask))
        reply = pb.JoinReply(client_id=joined.client_id, session_token=joined.session_token,
                             tier=joined.tier.tier, ffn_width=joined.tier.ffn_width,
                             tier_reason=joined.tier.reason, round=joined.round,
                             settings=encode_settings(joined.settings),
                             schema_hash=joined.schema_hash,
                             rounds_planned=joined.rounds_planned,
                             tokens_planned=joined.tokens_planned,
                             heartbeat_port=self.heartbeat_port)
        if joined.checkpoint is not None:
            reply.checkpoint.CopyFrom(encode_checkpoint(joined.checkpoint))
        return reply

    def Heartbeat(self, request: pb.HeartbeatRequest,
                  context: grpc.ServicerContext) -> pb.HeartbeatReply:
        client_id = self._session(context)
        speed = (request.tokens_per_second if request.HasField("tokens_per_second") else None)
        if speed is not None and not (math.isfinite(speed) and speed >= 0):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"tokens_per_second {speed} is not a finite, non-negative speed.")
        relayed = [(m.name, m.tier, m.tokens_per_second) for m in request.relayed]
        _call(context, lambda: self.coordinator.heartbeat(client_id, tokens_per_second=speed,
                                                          relayed=relayed))
        return pb.HeartbeatReply(round=self.coordinator.closed_rounds())

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        client_id = self._session(context)
        _call(context, lambda: self.coordinator.leave(client_id, request.reason[:200]))
        return pb.LeaveReply()

    # -- rounds -------------------------------------------------------------------------

    def GetRound(self, request: pb.GetRoundRequest,
                 context: grpc.ServicerContext) -> pb.RoundAssignment:
        """The member's oldest assignment not yet submitted (after ``after_round``, when
        the client holds the earlier ones); WAIT when it has none."""
        c = self.coordinator
        client_id = self._session(context)
        after = request.after_round if request.HasField("after_round") else None
        work = _call(context, lambda: c.work(client_id, after))
        if isinstance(work, Waiting):
            if work.finished:
                return pb.RoundAssignment(state=pb.ROUND_STATE_FINISHED, round=work.round,
                                          run_tokens=work.run_tokens)
            return pb.RoundAssignment(state=pb.ROUND_STATE_WAIT, round=work.round,
                                      retry_after_seconds=work.retry_after_s,
                                      run_tokens=work.run_tokens)
        return assignment_message(work, c.run_tokens, c.clock())

    def FetchSequences(self, request: pb.FetchSequencesRequest,
                       context: grpc.ServicerContext) -> Iterator[pb.Sequence]:
        """The assigned sequences asked for, each once (``MemberAPI.sequences`` refuses the
        rest before any is sent)."""
        client_id = self._session(context)
        with self._stream(context, client_id) as watch:
            sequences = self.coordinator.sequences(client_id, list(request.ids))
            yield from self._sent(watch, client_id, (
                pb.Sequence(id=i, tokens=encode_tensor(tokens)) for i, tokens in sequences))

    def SubmitResult(self, request_iterator: Iterator[pb.SubmitMessage],
                     context: grpc.ServicerContext) -> pb.SubmitReply:
        c = self.coordinator
        client_id = self._session(context)
        received = 0

        limit = c.max_submission_bytes()

        def counted(messages: Iterator[pb.SubmitMessage]) -> Iterator[pb.SubmitMessage]:
            nonlocal received
            for message in messages:
                received += message.ByteSize()
                if received > limit:
                    raise SubmissionTooLarge(
                        f"the submission passed {limit / 2**20:g} MiB ([faults] "
                        "max_submission_mb); send compressed results with the run's settings.")
                yield message

        def submit(watch: Watch) -> int:
            first, rest = read_submission(counted(watch.received(request_iterator)))
            header = decode_header(first)
            if header.client_id != client_id:
                raise _NotYourSession(f"the header names {header.client_id!r} but the session "
                                      f"is {client_id!r}; submit with your own client id.")
            expected = c.expects(client_id, header)
            assigned = expected.assignment
            watch.until(time.monotonic() + assigned.deadline - c.clock(), StaleRound(
                f"round {assigned.round} reached its deadline while this submission was "
                "still arriving; nothing of it was kept, wait for the next assignment."))
            # the whole upload first, at the link's pace, each result's parameter (a
            # relay's: and tier region) screened as it arrives; then each result checked
            # against its layout as it is decoded, and all of them whole, before the run
            # keeps any
            screen = screen_partials if expected.partials else screen_results
            screened = list(screen(rest, expected.layouts))
            if not context.is_active():  # gRPC ends the stream at a message it cannot parse
                raise MalformedStream("the SubmitResult stream broke off at a message that "
                                      "does not parse; nothing was kept, submit again.")
            with self._decoding:
                results = decode_screened(screened)
            c.submit_results(client_id, header, results, wire_bytes=received)
            return len(results)

        with self._stream(context, client_id) as watch:
            try:
                accepted = submit(watch)
            except (ProtocolError, CompressionError, BadResult) as err:
                # counted against the client: enough refusals exclude it from the run
                consequence = c.rejected(client_id, err)
                _abort(context, err, consequence)
            # the next round's work rides on the answer (overlapped rounds hand it out ahead)
            return pb.SubmitReply(accepted=accepted, assignments=[
                assignment_message(a, c.run_tokens, c.clock()) for a in c.pending(client_id)])

    # -- catching up --------------------------------------------------------------------

    def GetUpdates(self, request: pb.GetUpdatesRequest,
                   context: grpc.ServicerContext) -> Iterator[pb.UpdateMessage]:
        """The logged updates of rounds ``since_round``, since_round + 1, ...: a checkpoint
        reference's ``round`` counts the rounds inside it, so it is the first to replay. A
        client ahead of the log waits for the close in a call slot, not a stream's.
        ``headers_only``: each round's header alone (a round's first message), what a member
        checks the rounds it takes from a mirror against."""
        client_id = self._session(context)
        tier = request.tier if request.HasField("tier") else None  # the replica's
        rounds = _call(context, lambda: self.coordinator.update_rounds(
            client_id, request.since_round, tier, min(request.wait_seconds, MAX_WAIT_S)))
        with self._stream(context, client_id) as watch:
            for i, messages in enumerate(rounds):
                if i == 0 and not request.headers_only and carries_values(messages):
                    context.set_compression(grpc.Compression.Gzip)
                if request.headers_only:
                    yield from self._sent(watch, client_id, itertools.islice(messages, 1))
                else:
                    yield from self._sent(watch, client_id, messages, rounds=1)

    def GetCheckpoint(self, request: pb.GetCheckpointRequest,
                      context: grpc.ServicerContext) -> pb.CheckpointRef:
        client_id = self._session(context)
        return encode_checkpoint(_call(context, lambda: self.coordinator.checkpoint(client_id)))

    def DownloadCheckpoint(self, request: pb.DownloadCheckpointRequest,
                           context: grpc.ServicerContext) -> Iterator[pb.FileChunk]:
        """A manifest or a file it lists, checked against its sha256 before and while it is
        sent: anything else is NOT_FOUND, a copy that fails its manifest DATA_LOSS."""
        client_id = self._session(context)
        with self._stream(context, client_id) as watch:
            try:
                yield from self._sent(watch, client_id,
                                      self.coordinator.checkpoint_chunks(request.path))
            except (ProtocolError, FileNotServed, ServedFileDamaged) as err:
                _abort(context, err)
            except OSError as err:  # whatever else the file system refuses: not a served file
                context.abort(grpc.StatusCode.NOT_FOUND,
                              f"{request.path[:200]!r} cannot be read ({err.strerror}); take "
                              "paths from the manifest.")

    # -- helpers ------------------------------------------------------------------------

    def _sent(self, watch: Watch, client_id: str, messages: Iterable[M], *, rounds: int = 0
              ) -> Iterator[M]:
        """``messages`` sent under ``watch``, their bytes counted as downloaded by
        ``client_id`` once the stream ends or breaks off (``rounds``: round updates it holds,
        when sent whole)."""
        before, whole = watch.sent_bytes, False
        try:
            yield from watch.sent(iter(messages))
            whole = True
        finally:
            self.coordinator.downloaded(client_id, watch.sent_bytes - before,
                                        rounds=rounds if whole else 0)

    def _session(self, context: grpc.ServicerContext) -> str:
        """The calling client's id, from its session token; aborts UNAUTHENTICATED for a
        missing, unknown or expired token and PERMISSION_DENIED for an excluded client."""
        token = presented_session(context)
        return _call(context, lambda: self.coordinator.authenticate(token))

    @contextmanager
    def _stream(self, context: grpc.ServicerContext, client_id: str) -> Iterator[Watch]:
        """A stream slot of ``client_id`` and the watch on the call's waits for its peer; a
        refusal raised in the block (the watchdog's among them) ends the call with its status."""
        try:
            with self.slots.stream(client_id, end=lambda err: end_call(context, err)) as watch:
                yield watch
        except _REFUSED as err:
            _abort(context, err)

class _NotYourSession(ProtocolError):
    code = grpc.StatusCode.PERMISSION_DENIED


def capabilities_of(request: pb.JoinRequest, sequence_length: int) -> Capabilities:
    """What a Join says of the client, as the tier policy reads it (checked there)."""
    caps = request.capabilities
    return Capabilities(
        name=request.client_name or "client", device_kind=caps.device_kind or "cpu",
        memory_bytes=caps.memory_bytes,
        requested_tier=caps.requested_tier if caps.HasField("requested_tier") else None,
        tokens_per_second=caps.tokens_per_second,
        # a client that does not say runs at least one sequence per pass
        microbatch_tokens=caps.microbatch_tokens or sequence_length,
        device_name=caps.device_name[:200], relay=request.relay)


def assignment_message(assigned: RoundAssignment, run_tokens: int, now: float
                       ) -> pb.RoundAssignment:
    """A member's work in a round: ROUND_STATE_TRAIN (``run_tokens``: the run's so far;
    ``now``: the clock the assignment's deadline is on)."""
    return pb.RoundAssignment(
        state=pb.ROUND_STATE_TRAIN, round=assigned.round,
        sequence_ids=assigned.sequence_ids, tier=assigned.tier,
        assignment_id=assigned.assignment_id, run_tokens=run_tokens,
        deadline_in_seconds=max(assigned.deadline - now, 0.0))


def _call(context: grpc.ServicerContext, action: Callable[[], T]) -> T:
    """``action()``, with any error raised on purpose turned into the call's status."""
    try:
        return action()
    except _REFUSED as err:
        _abort(context, err)


def _abort(context: grpc.ServicerContext, err: Exception, more: str = "") -> NoReturn:
    context.abort(_status(err), str(err) + more)
    raise AssertionError("unreachable: context.abort raises")


def _status(err: Exception) -> grpc.StatusCode:
    return getattr(err, "code", grpc.StatusCode.INVALID_ARGUMENT)
