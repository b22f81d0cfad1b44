"""The Coordinator service a relay's members call (protocol/matformer/v1/coordinator.proto):
the same contract as the root's, answered from the relay's state (``relay.relay``) and its
caches (``relay.cache``). A member cannot tell a relay from a root.

Every refusal is the root's own error type with its status; what the root answers the relay
(a pruned round, a missing file) is passed on with the root's status and words.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NoReturn, TypeVar

import grpc

from matformer.modeling.errors import CompressionError, MatformerError
from matformer.protocol.auth import check_join_token, require_session
from matformer.protocol.errors import MalformedStream, ProtocolError
from matformer.protocol.files import send_file
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.protocol.submission import read_results, read_submission
from matformer.relay.relay import Relay
from matformer.server.errors import BadResult, CoordinatorError, TierAssignmentError
from matformer.server.replies import assignment
from matformer.server.service import capabilities_of, check_schema

T = TypeVar("T")
RETRY_AFTER_S = 0.25  # a member with no part in a held round asks again after this
_REFUSED = (ProtocolError, CompressionError, CoordinatorError, TierAssignmentError, BadResult,
            MatformerError)


class RelayService(pb_grpc.CoordinatorServicer):
    def __init__(self, relay: Relay, join_token: str) -> None:
        self.relay = relay
        self.join_token = join_token

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> pb.JoinReply:
        r = self.relay
        check_join_token(context, request.join_token, self.join_token)
        if request.relay:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "a relay joins the root, not another relay; give it the root's "
                          "address as --upstream.")
        joined = r.joined
        check_schema(context, request, joined.schema_hash)
        capabilities = capabilities_of(request, joined.settings.sequence_length)
        member, tier, token = _call(context, lambda: r.join(capabilities))
        reply = pb.JoinReply()
        reply.CopyFrom(joined)  # the run's settings, schema, plan and checkpoint
        reply.client_id, reply.session_token = member.client_id, token
        reply.tier, reply.ffn_width, reply.tier_reason = tier.tier, tier.ffn_width, tier.reason
        return reply

    def Heartbeat(self, request: pb.HeartbeatRequest,
                  context: grpc.ServicerContext) -> pb.HeartbeatReply:
        client_id = self._session(context)
        speed = request.tokens_per_second if request.HasField("tokens_per_second") else None
        _call(context, lambda: self.relay.seen(client_id, speed))
        return pb.HeartbeatReply(round=self.relay.root_round)

    def Leave(self, request: pb.LeaveRequest, context: grpc.ServicerContext) -> pb.LeaveReply:
        self.relay.leave(self._session(context))
        return pb.LeaveReply()

    def GetRound(self, request: pb.GetRoundRequest,
                 context: grpc.ServicerContext) -> pb.RoundAssignment:
        r = self.relay
        client_id = self._session(context)
        _call(context, lambda: r.seen(client_id))
        # the root's round: a member catches up to it before it trains or finishes
        if r.finished:
            return pb.RoundAssignment(state=pb.ROUND_STATE_FINISHED, round=r.root_round,
                                      run_tokens=r.run_tokens)
        after = request.after_round if request.HasField("after_round") else None
        part = r.assignment_for(client_id, after)
        if part is None:
            return pb.RoundAssignment(state=pb.ROUND_STATE_WAIT, round=r.root_round,
                                      retry_after_seconds=RETRY_AFTER_S,
                                      run_tokens=r.run_tokens)
        return assignment(part, r.run_tokens, r.clock())

    def FetchSequences(self, request: pb.FetchSequencesRequest,
                       context: grpc.ServicerContext) -> Iterator[pb.Sequence]:
        client_id = self._session(context)
        yield from _call(context, lambda: self.relay.sequences(client_id, list(request.ids)))

    def SubmitResult(self, request_iterator: Iterator[pb.SubmitMessage],
                     context: grpc.ServicerContext) -> pb.SubmitReply:
        r = self.relay
        client_id = self._session(context)

        def submit() -> int:
            header, rest = read_submission(request_iterator)
            part = r.part_of(client_id, header.round, header.assignment_id)
            results = list(read_results(rest, r.layouts[part.assignment.tier]))
            if not context.is_active():
                raise MalformedStream("the SubmitResult stream broke off; submit again.")
            r.submit(client_id, header, results)
            return len(results)

        accepted = _call(context, submit)
        # the member's next parts ride on the answer (overlapped rounds: held ahead)
        return pb.SubmitReply(accepted=accepted, assignments=[
            assignment(part, r.run_tokens, r.clock()) for part in r.pending(client_id)])

    def GetUpdates(self, request: pb.GetUpdatesRequest,
                   context: grpc.ServicerContext) -> Iterator[pb.UpdateMessage]:
        r = self.relay
        client_id = self._session(context)
        member = _call(context, lambda: r.seen(client_id))
        tier = request.tier if request.HasField("tier") else member.tier
        yield from _upstream(context, lambda: r.updates.messages(
            request.since_round, tier, min(request.wait_seconds, 30.0)))

    def GetCheckpoint(self, request: pb.GetCheckpointRequest,
                      context: grpc.ServicerContext) -> pb.CheckpointRef:
        self._session(context)
        return _upstream(context, self.relay.root.checkpoint)

    def DownloadCheckpoint(self, request: pb.DownloadCheckpointRequest,
                           context: grpc.ServicerContext) -> Iterator[pb.FileChunk]:
        self._session(context)
        path = _upstream(context, lambda: _call(context, lambda: self.relay.files.path(
            request.path)))
        yield from send_file(path)

    def _session(self, context: grpc.ServicerContext) -> str:
        return require_session(context, self.relay.sessions)


def _call(context: grpc.ServicerContext, action: Callable[[], T]) -> T:
    """``action()``, with any error raised on purpose turned into the call's status."""
    try:
        return action()
    except _REFUSED as err:
        _abort(context, getattr(err, "code", grpc.StatusCode.INVALID_ARGUMENT), str(err))


def _upstream(context: grpc.ServicerContext, action: Callable[[], T]) -> T:
    """``action()``, with the root's refusal passed on as the root gave it."""
    try:
        return action()
    except grpc.RpcError as err:
        _abort(context, err.code(), f"the root: {err.details()}")


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    context.abort(code, details)
    raise AssertionError("unreachable: context.abort raises")

