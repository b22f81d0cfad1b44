"""The relay's end of the root's protocol: the relay as one member of the root, and the
relay's transport edge to it (as ``client/connection.py`` is a member's).

    root = Upstream("root.example:7070", name="relay-eu", join_token=token)  # tls_ca=...
    joined = root.join(tokens_per_second=0.0)      # Joined: the relay's session and the run
    work = root.get_round(after=None)              # RootWork
    root.fetch(ids); root.submit(header, partials); root.updates(since, tier, wait_s)
    root.published(since, tier, wait_s)            # the rounds' headers alone
    root.checkpoint(); root.download(path, dest)

The relay's core sees the project's records only: what the root answers comes back as them,
and what it refuses as ``UpstreamError`` with the root's status and words. Updates and files
are passed on as the messages they are (the relay forwards them byte for byte), and every
byte each way is counted: what the root sees of this relay.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from google.protobuf.message import Message
from torch import Tensor

from matformer.modeling.compression import SparseResult
from matformer.protocol.auth import session_metadata
from matformer.protocol.channel import open_channel
from matformer.protocol.files import receive_file
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.protocol.records import (
    ServedCheckpoint,
    SubmitHeader,
    decode_checkpoint,
    encode_header,
)
from matformer.protocol.settings import decode_settings
from matformer.protocol.submission import submission_messages
from matformer.protocol.tensors import decode_tensor
from matformer.protocol.updates import RoundHeader, read_headers
from matformer.server.errors import UpstreamError
from matformer.server.member_api import Joined
from matformer.server.tiers import TierAssignment

FRAME_BYTES = 5  # gRPC's length-prefixed framing per message
CALL_S = 60.0  # a unary call's answer
TRANSFER_S = 600.0  # a stream's whole transfer (sequences, results, a checkpoint file)
# Streams at once: the root lets one member hold 4 calls, 3 of them streams ([faults]), and
# the relay's heartbeat and GetRound may be two of the 4.
STREAMS = 2
STATES = {pb.ROUND_STATE_TRAIN: "train", pb.ROUND_STATE_WAIT: "wait",
          pb.ROUND_STATE_FINISHED: "finished"}


@dataclass(frozen=True, slots=True)
class RootWork:
    """The root's answer to the relay's GetRound: work to split (``state`` "train"), none
    yet ("wait": ask again after ``retry_after_s``), or the run's end ("finished")."""

    state: str
    round: int  # the work's round ("train"), else the rounds the root has closed
    run_tokens: int
    sequence_ids: tuple[int, ...] = ()
    assignment_id: str = ""
    deadline_in_s: float = 0.0  # 0: a root too old to say
    retry_after_s: float = 0.0


@contextmanager
def _answered() -> Iterator[None]:
    """The root's refusal of the call in the block, as the relay's own error."""
    try:
        yield
    except grpc.RpcError as err:
        raise UpstreamError(err.code(), err.details() or err.code().name) from None


class Upstream:
    def __init__(self, address: str, *, name: str, join_token: str, run_id: str = "",
                 tls_ca: Path | None = None) -> None:
        """``join_token``: the run's join token, or (``[auth] mode = "keys"``) the relay's
        own client key; ``tls_ca``: the root's certificate, to connect with TLS."""
        self.address = address
        self.name = name
        self._join_token = join_token
        self._run_id = run_id
        self._channel = open_channel(address, tls_ca=tls_ca)
        self.stub = pb_grpc.CoordinatorStub(self._channel)
        self.metadata: tuple[tuple[str, str], ...] = ()
        self.client_id = ""
        self.bytes_up = 0  # every message this relay sent the root, framed
        self.bytes_down = 0  # ... and received from it
        self._streams = threading.BoundedSemaphore(STREAMS)

    def close(self) -> None:
        self._channel.close()

    def join(self, *, tokens_per_second: float) -> Joined:
        with _answered():
            reply = self._in(self.stub.Join(self._out(pb.JoinRequest(
                run_id=self._run_id, join_token=self._join_token, client_name=self.name,
                relay=True, capabilities=pb.Capabilities(
                    device_kind="relay", device_name="relay", memory_bytes=1,
                    tokens_per_second=tokens_per_second))), timeout=CALL_S))
        self.metadata = session_metadata(reply.session_token)
        self.client_id = reply.client_id
        return Joined(
            client_id=reply.client_id, session_token=reply.session_token,
            tier=TierAssignment(tier=reply.tier, ffn_width=reply.ffn_width, estimated_bytes=0,
                                reason=reply.tier_reason),
            round=reply.round, settings=decode_settings(reply.settings),
            checkpoint=(decode_checkpoint(reply.checkpoint) if reply.HasField("checkpoint")
                        else None),
            schema_hash=reply.schema_hash, rounds_planned=reply.rounds_planned,
            tokens_planned=reply.tokens_planned)

    def heartbeat(self, round_index: int, tokens_per_second: float,
                  members: Sequence[tuple[str, int, float]] = ()) -> int:
        """Alive, at this speed, with these members (name, tier, tokens/s) behind it; the
        rounds the root has closed."""
        with _answered():
            return self._in(self.stub.Heartbeat(self._out(pb.HeartbeatRequest(
                round=round_index, tokens_per_second=tokens_per_second,
                relayed=[pb.RelayedMember(name=n, tier=t, tokens_per_second=s)
                         for n, t, s in members])), metadata=self.metadata,
                timeout=CALL_S)).round

    def get_round(self, after: int | None = None) -> RootWork:
        request = pb.GetRoundRequest() if after is None else pb.GetRoundRequest(after_round=after)
        with _answered():
            work = self._in(self.stub.GetRound(self._out(request), metadata=self.metadata,
                                               timeout=CALL_S))
        return RootWork(state=STATES.get(work.state, "wait"), round=work.round,
                        run_tokens=work.run_tokens, sequence_ids=tuple(work.sequence_ids),
                        assignment_id=work.assignment_id,
                        deadline_in_s=work.deadline_in_seconds,
                        retry_after_s=work.retry_after_seconds)

    def fetch(self, ids: Sequence[int]) -> dict[int, Tensor]:
        """The sequences ``ids`` (each once) as the root sends them: each one's tokens."""
        with self._streams, _answered():
            stream = self.stub.FetchSequences(self._out(pb.FetchSequencesRequest(ids=ids)),
                                              metadata=self.metadata, timeout=TRANSFER_S)
            return {s.id: decode_tensor(s.tokens) for s in map(self._in, stream)}

    def submit(self, header: SubmitHeader, results: Iterable[SparseResult]) -> None:
        messages = (self._out(m) for m in submission_messages(encode_header(header), results))
        with self._streams, _answered():
            self._in(self.stub.SubmitResult(messages, metadata=self.metadata,
                                            timeout=TRANSFER_S))

    def updates(self, since_round: int, tier: int, wait_s: float) -> list[pb.UpdateMessage]:
        with self._streams, _answered():
            return [self._in(m) for m in self.stub.GetUpdates(self._out(pb.GetUpdatesRequest(
                since_round=since_round, tier=tier, wait_seconds=wait_s)),
                metadata=self.metadata, timeout=wait_s + TRANSFER_S)]

    def published(self, since_round: int, tier: int, wait_s: float) -> list[RoundHeader]:
        """The headers alone of the rounds ``updates`` would give (weight hash, rule,
        parameter updates): what a mirror's rounds are checked against."""
        with self._streams, _answered():
            return list(read_headers(self._in(m) for m in self.stub.GetUpdates(
                self._out(pb.GetUpdatesRequest(since_round=since_round, tier=tier,
                                               wait_seconds=wait_s, headers_only=True)),
                metadata=self.metadata, timeout=wait_s + CALL_S)))

    def checkpoint(self) -> ServedCheckpoint:
        with _answered():
            return decode_checkpoint(self._in(self.stub.GetCheckpoint(
                self._out(pb.GetCheckpointRequest()), metadata=self.metadata, timeout=CALL_S)))

    def download(self, path: str, dest: Path) -> str:
        """A file of the root's checkpoint directory to ``dest`` (atomically); its sha256."""
        with self._streams, _answered():
            chunks = self.stub.DownloadCheckpoint(self._out(pb.DownloadCheckpointRequest(
                path=path)), metadata=self.metadata, timeout=TRANSFER_S)
            return receive_file(map(self._in, chunks), dest)

    def leave(self, reason: str) -> None:
        with _answered():
            self.stub.Leave(self._out(pb.LeaveRequest(reason=reason)), metadata=self.metadata,
                            timeout=10.0)

    def _out(self, message: Message) -> Message:
        self.bytes_up += message.ByteSize() + FRAME_BYTES
        return message

    def _in(self, message: Message) -> Message:
        self.bytes_down += message.ByteSize() + FRAME_BYTES
        return message


def rounds_of(messages: Iterable[pb.UpdateMessage]) -> Iterator[tuple[int, list[pb.UpdateMessage]]]:
    """A GetUpdates stream cut into its rounds: each header with the parameter messages it
    announces."""
    current: list[pb.UpdateMessage] = []
    for message in messages:
        if message.WhichOneof("item") == "header":
            if current:
                yield current[0].header.round, current
            current = [message]
        elif current:
            current.append(message)
    if current:
        yield current[0].header.round, current
