"""The Coordinator gRPC service (protocol/matformer/v1/coordinator.proto) over a ``Coordinator``.

    servicer = CoordinatorService(coordinator)
    pb_grpc.add_CoordinatorServicer_to_server(servicer, grpc_server)

Every handler turns the errors its helpers raise on purpose into a status with
``context.abort(err.code, str(err))``: ``ProtocolError`` and ``CompressionError`` (malformed
messages: INVALID_ARGUMENT), ``CoordinatorError`` / ``TierAssignmentError`` (each with its own
code). A rejected submission leaves the round's aggregate untouched: the coordinator keeps all
of a submission or none of it, and counts a refused one against the client
(``Coordinator.rejected``). ``Join`` authenticates with the run's join token (unless
``[auth] mode = "none"``); every other RPC with the session token ``Join`` issued
(``Coordinator.authenticate``: UNAUTHENTICATED when unknown or expired, PERMISSION_DENIED
once the client is excluded). Every call holds one of the member's call slots, and a stream
one of its stream slots (server/call_slots.py; the gate in front of this service takes the
call slot): RESOURCE_EXHAUSTED beyond a member's share, UNAVAILABLE when every shared stream
slot is taken (a member the open round assigned work to always has one stream of its own),
DEADLINE_EXCEEDED for a stream that waited on its peer too long. A submission's header is
checked before any of its results is read, and each result against the run's layout for
the sender's tier (protocol/sparse.py) before it is decoded.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NoReturn, TypeVar

import grpc
import torch
from google.protobuf.message import Message

from matformer.modeling.checkpoint.schema import canonical_schema_hash
from matformer.modeling.compression import Region
from matformer.modeling.errors import CheckpointError, CompressionError
from matformer.protocol.auth import SESSION_METADATA_KEY, check_join_token, presented_session
from matformer.protocol.errors import MalformedStream, ProtocolError
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.protocol.sparse import ResultLayout, partial_layouts, result_layouts
from matformer.protocol.submission import read_partials, read_results, read_submission
from matformer.protocol.tensors import encode_tensor
from matformer.server import replies
from matformer.server.call_slots import CallLimits, CallSlots, Watch, end_call
from matformer.server.coordinator import Coordinator
from matformer.server.errors import (
    BadResult,
    CallRefused,
    CoordinatorError,
    FileNotServed,
    NotARunTier,
    RepeatedSequenceIds,
    ServedFileDamaged,
    StaleRound,
    SubmissionTooLarge,
    TierAssignmentError,
    UpdatesPruned,
)
from matformer.server.keys import KeyFile, KeyFileError, KeyHolder
from matformer.server.served_files import served_files
from matformer.server.tiers import Capabilities
from matformer.server.update_cache import UpdateCache

log = logging.getLogger("matformer.server")

RETRY_AFTER_S = 0.5  # how soon a waiting client asks GetRound again, at most
MIN_RETRY_AFTER_S = 0.05  # ... and at least, when the coordinator expects work for it sooner
MAX_WAIT_S = 30.0  # the longest GetUpdates holds a stream waiting for a round to close

T = TypeVar("T")
M = TypeVar("M", bound=Message)
_REFUSED = (ProtocolError, CompressionError, CoordinatorError, TierAssignmentError,
            CallRefused, RepeatedSequenceIds)


class CoordinatorService(pb_grpc.CoordinatorServicer):
    def __init__(self, coordinator: Coordinator, limits: CallLimits) -> None:
        self.coordinator = coordinator
        # a member with work in the open round always has a stream of its own
        self.slots = CallSlots(limits, assigned=lambda client_id: (
            coordinator.assignment_for(client_id) is not None))
        # GetUpdates from memory: each round encoded once per tier, fed by every close
        self._result_layouts: dict[int, dict[str, ResultLayout]] = {}  # by tier (_layouts)
        self._relay_layouts: dict[tuple[str, Region], ResultLayout] | None = None
        self.updates = UpdateCache(read=coordinator.log.read, regions=coordinator.regions)
        coordinator.round_closed.append(lambda closed: self.updates.put(closed.update))
        self.schema_hash = canonical_schema_hash(coordinator.model_config, coordinator.shapes)

    # -- join and membership ------------------------------------------------------------

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        c = self.coordinator
        key = None
        if c.config.auth.mode == "token":  # "none" admits anyone; the server is loopback-only
            check_join_token(context, request.join_token, c.config.auth.token())
        elif c.config.auth.mode == "keys":
            key = self._key_holder(request.join_token, context)
        if request.run_id and request.run_id != c.config.run.id:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this server runs {c.config.run.id!r}, not {request.run_id!r}; "
                          "check --server.")
        check_schema(context, request, self.schema_hash)
        if request.relay and not c.policy.takes_partials:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"this run's round policy, {c.policy.describe()}, must see each "
                          "member's result, which a relay's partial sum hides; join its "
                          "members directly, or run a policy that takes sums ([policy] name "
                          "= \"mean\", [update] vote = \"mean\").")
        capabilities = capabilities_of(request, c.config.data.max_seq_len)
        # a restarted client presents the session it had, to take its name back at once
        previous = dict(context.invocation_metadata()).get(SESSION_METADATA_KEY)
        member, tier, token = _call(context, lambda: c.join(capabilities, key=key,
                                                            previous_session=previous))
        return pb.JoinReply(client_id=member.client_id, session_token=token, tier=tier.tier,
                            ffn_width=tier.ffn_width, tier_reason=tier.reason,
                            round=c.state.round,
                            checkpoint=replies.checkpoint_ref(c, tier.tier),
                            settings=replies.settings(c), schema_hash=self.schema_hash,
                            **replies.planned(c))

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
        return pb.HeartbeatReply(round=self.coordinator.state.round)

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
        _call(context, lambda: c.heartbeat(client_id))
        if c.phase == "finished":
            return pb.RoundAssignment(state=pb.ROUND_STATE_FINISHED, round=c.state.round,
                                      run_tokens=c.state.tokens)
        after = request.after_round if request.HasField("after_round") else None
        assignment = c.assignment_for(client_id, after)
        if assignment is None:
            expected = c.next_work_in(client_id)
            retry = RETRY_AFTER_S if expected is None else min(
                RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, expected))
            return pb.RoundAssignment(state=pb.ROUND_STATE_WAIT, round=c.state.round,
                                      retry_after_seconds=retry, run_tokens=c.state.tokens)
        return replies.assignment(assignment, c.state.tokens, c.clock())

    def FetchSequences(self, request: pb.FetchSequencesRequest,
                       context: grpc.ServicerContext) -> Iterator[pb.Sequence]:
        """The assigned sequences asked for, each once: ids beyond the data, outside the
        client's assignment in the round being collected, or repeated, are refused (so a
        request holds no more ids than the assignment)."""
        c = self.coordinator
        client_id = self._session(context)
        with self._stream(context, client_id) as watch:
            reader, ids = c.reader, list(request.ids)
            bad = [i for i in ids if i >= len(reader)]
            if bad:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"sequence ids {bad[:5]} are outside the run's {len(reader)} "
                              "sequences; fetch the ids GetRound assigned.")
            held = {i for a in c.pending(client_id) for i in a.sequence_ids}
            foreign = sorted(set(ids) - held)
            if foreign:  # a client reads only the sequences it is assigned now
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"sequence ids {foreign[:5]} are not in {client_id}'s assignment "
                              "for the round being collected (it closed, or they are another "
                              "client's); ask GetRound for the current assignment.")
            counts = Counter(ids)
            if len(counts) < len(ids):
                repeated = sorted(i for i, n in counts.items() if n > 1)
                raise RepeatedSequenceIds(
                    f"the request names sequence ids {repeated[:5]} more than once ({len(ids)} "
                    f"ids, {len(counts)} distinct); ask for each assigned id once.")
            yield from self._sent(watch, client_id, (
                pb.Sequence(id=i, tokens=encode_tensor(torch.from_numpy(reader[i].copy())))
                for i in ids))

    def _layouts(self, tier: int) -> dict[str, ResultLayout]:
        """What the run accepts of each parameter from a client of ``tier``: fixed for the
        run, so built once per tier."""
        if tier not in self._result_layouts:
            c = self.coordinator
            self._result_layouts[tier] = result_layouts(c.config.compression.build(), c.shapes,
                                                        c.regions(tier))
        return self._result_layouts[tier]

    def _partial_layouts(self) -> dict[tuple[str, Region], ResultLayout]:
        """What the run accepts from a relay: built once."""
        if self._relay_layouts is None:
            c = self.coordinator
            self._relay_layouts = partial_layouts(
                c.config.compression.build(), c.shapes,
                {t: c.regions(t) for t in c.config.tiers.allowed})
        return self._relay_layouts

    def SubmitResult(self, request_iterator: Iterator[pb.SubmitMessage],
                     context: grpc.ServicerContext) -> pb.SubmitReply:
        c = self.coordinator
        client_id = self._session(context)
        received = 0

        limit = c.config.faults.max_submission_bytes

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
            header, rest = read_submission(counted(watch.received(request_iterator)))
            if header.client_id != client_id:
                raise _NotYourSession(f"the header names {header.client_id!r} but the session "
                                      f"is {client_id!r}; submit with your own client id.")
            assignment = c.check_header(client_id, header.round, header.assignment_id)
            watch.until(time.monotonic() + assignment.deadline - c.clock(), StaleRound(
                f"round {assignment.round} reached its deadline while this submission was "
                "still arriving; nothing of it was kept, wait for the next assignment."))
            # each result checked against the run's layout for the assigned tier (a relay's:
            # for a tier region) before it is decoded, then checked whole, before the
            # coordinator sees any
            if c.membership.get(client_id).relay:
                results = list(read_partials(rest, self._partial_layouts()))
            else:
                results = list(read_results(rest, self._layouts(assignment.tier)))
            if not context.is_active():  # gRPC ends the stream at a message it cannot parse
                raise MalformedStream("the SubmitResult stream broke off at a message that "
                                      "does not parse; nothing was kept, submit again.")
            c.submit(client_id, header.round, results, loss=header.loss,
                     train_seconds=header.train_seconds, assignment_id=header.assignment_id,
                     wire_bytes=received, missed=list(header.missed_ids),
                     tier_losses=[(t.tier, t.tokens, t.loss) for t in header.tier_losses])
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
                replies.assignment(a, c.state.tokens, c.clock()) for a in c.pending(client_id)])

    # -- catching up --------------------------------------------------------------------

    def GetUpdates(self, request: pb.GetUpdatesRequest,
                   context: grpc.ServicerContext) -> Iterator[pb.UpdateMessage]:
        """The logged updates of rounds ``since_round``, since_round + 1, ...: a checkpoint
        reference's ``round`` counts the rounds inside it, so it is the first to replay."""
        c = self.coordinator
        client_id = self._session(context)
        tier = _call(context, lambda: c.membership.get(client_id).tier)
        if request.HasField("tier"):  # the replica's, which lags a move by a round or two
            tier = _call(context, lambda: _run_tier(c, request.tier))
        if request.wait_seconds > 0:  # a client ahead of the log waits for the close, in a
            # call slot but not a stream's: nothing is in flight yet
            c.wait_for_round(request.since_round, min(request.wait_seconds, MAX_WAIT_S))
        with self._stream(context, client_id) as watch:
            rounds = _call(context, lambda: c.logged_rounds(request.since_round))
            context.set_compression(grpc.Compression.Gzip)  # ternary signs compress ~5x more
            for round_index in rounds:
                try:
                    messages = self.updates.messages(round_index, tier)
                except (OSError, CheckpointError):  # pruned since: a checkpoint holds it now
                    _abort(context, UpdatesPruned(
                        f"round {round_index} left the update log while it was being sent; "
                        "load the latest checkpoint (GetCheckpoint) and ask again."))
                yield from self._sent(watch, client_id, messages, rounds=1)

    def GetCheckpoint(self, request: pb.GetCheckpointRequest,
                      context: grpc.ServicerContext) -> pb.CheckpointRef:
        c = self.coordinator
        client_id = self._session(context)
        tier = _call(context, lambda: c.membership.get(client_id).tier)
        return _call(context, lambda: replies.checkpoint_ref(c, tier))

    def DownloadCheckpoint(self, request: pb.DownloadCheckpointRequest,
                           context: grpc.ServicerContext) -> Iterator[pb.FileChunk]:
        """A manifest or a file it lists, checked against its sha256 before and while it is
        sent: anything else is NOT_FOUND, a copy that fails its manifest DATA_LOSS."""
        client_id = self._session(context)
        with self._stream(context, client_id) as watch:
            try:
                yield from self._sent(watch, client_id,
                                      served_files(self.checkpoints).chunks(request.path))
            except (ProtocolError, FileNotServed, ServedFileDamaged) as err:
                _abort(context, err)
            except OSError as err:  # whatever else the file system refuses: not a served file
                context.abort(grpc.StatusCode.NOT_FOUND,
                              f"{request.path[:200]!r} cannot be read ({err.strerror}); take "
                              "paths from the manifest.")

    @property
    def checkpoints(self) -> Path:
        return self.coordinator.dir / "checkpoints"

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

    def _key_holder(self, presented: str, context: grpc.ServicerContext) -> KeyHolder:
        """Whose client key the Join presents; UNAUTHENTICATED for a key the keys file does
        not hold, UNAVAILABLE (the reason logged, not told) when the file cannot be read."""
        try:
            holder = KeyFile(self.coordinator.config.keys_path).holder(presented)
        except KeyFileError as err:
            log.error("%s", err)
            context.abort(grpc.StatusCode.UNAVAILABLE, "the coordinator cannot read its client "
                          "keys; tell the run's operator.")
        if holder is None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "unknown client key; this run admits only clients with a key its "
                          "operator issued (matformer-server keys add NAME): pass it as "
                          "--join-token.")
        return holder

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


def check_schema(context: grpc.ServicerContext, request: pb.JoinRequest, schema_hash: str
                 ) -> None:
    """FAILED_PRECONDITION for a Join whose model is not the run's. No schema: the client
    loads the run's checkpoint after joining and checks JoinReply.schema_hash itself."""
    if request.HasField("schema") and request.schema.canonical_hash != schema_hash:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      f"the client's model has canonical schema hash "
                      f"{request.schema.canonical_hash or '(none)'}, the run's model "
                      f"{schema_hash}; load the run's checkpoint (--checkpoint server).")


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


def _run_tier(c: Coordinator, tier: int) -> int:
    """``tier`` if the run has it (its updates record a hash of every allowed tier)."""
    allowed = c.config.tiers.allowed
    if tier not in allowed:
        raise NotARunTier(f"updates asked for at tier {tier}, which this run does not have "
                          f"(its tiers: {', '.join(map(str, allowed))}).")
    return tier


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
