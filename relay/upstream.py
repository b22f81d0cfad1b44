"""The relay's end of the root's protocol: the relay as one member of the root.

    root = Upstream("root.example:7070", name="relay-eu", join_token=token)  # tls_ca=...
    joined = root.join(tokens_per_second=0.0)      # pb.JoinReply; the relay's session
    work = root.get_round(after=None)              # pb.RoundAssignment
    root.fetch(ids); root.submit(header, partials); root.updates(since, tier, wait_s)
    root.checkpoint(); root.download(path, dest)

Messages are passed on as they are (the relay forwards updates and files byte for byte),
and every byte each way is counted: what the root sees of this relay.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from google.protobuf.message import Message

from matformer.modeling.compression import SparseResult
from matformer.protocol.auth import session_metadata
from matformer.protocol.channel import open_channel
from matformer.protocol.files import receive_file
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.protocol.submission import submission_messages

FRAME_BYTES = 5  # gRPC's length-prefixed framing per message
CALL_S = 60.0  # a unary call's answer
TRANSFER_S = 600.0  # a stream's whole transfer (sequences, results, a checkpoint file)
# Streams at once: the root lets one member hold 4 calls, 3 of them streams ([faults]), and
# the relay's heartbeat and GetRound may be two of the 4.
STREAMS = 2


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

    def join(self, *, tokens_per_second: float) -> pb.JoinReply:
        reply = self._in(self.stub.Join(self._out(pb.JoinRequest(
            run_id=self._run_id, join_token=self._join_token, client_name=self.name,
            relay=True, capabilities=pb.Capabilities(
                device_kind="relay", device_name="relay", memory_bytes=1,
                tokens_per_second=tokens_per_second))), timeout=CALL_S))
        self.metadata = session_metadata(reply.session_token)
        self.client_id = reply.client_id
        return reply

    def heartbeat(self, round_index: int, tokens_per_second: float,
                  members: Sequence[tuple[str, int, float]] = ()) -> pb.HeartbeatReply:
        """Alive, at this speed, with these members (name, tier, tokens/s) behind it."""
        return self._in(self.stub.Heartbeat(self._out(pb.HeartbeatRequest(
            round=round_index, tokens_per_second=tokens_per_second,
            relayed=[pb.RelayedMember(name=n, tier=t, tokens_per_second=s)
                     for n, t, s in members])), metadata=self.metadata, timeout=CALL_S))

    def get_round(self, after: int | None = None) -> pb.RoundAssignment:
        request = pb.GetRoundRequest() if after is None else pb.GetRoundRequest(after_round=after)
        return self._in(self.stub.GetRound(self._out(request), metadata=self.metadata,
                                           timeout=CALL_S))

    def fetch(self, ids: Sequence[int]) -> dict[int, pb.Sequence]:
        """The sequences ``ids`` (each once) as the root sends them."""
        with self._streams:
            stream = self.stub.FetchSequences(self._out(pb.FetchSequencesRequest(ids=ids)),
                                              metadata=self.metadata, timeout=TRANSFER_S)
            return {s.id: s for s in map(self._in, stream)}

    def submit(self, header: pb.SubmitHeader, results: Iterable[SparseResult]
               ) -> pb.SubmitReply:
        messages = (self._out(m) for m in submission_messages(header, results))
        with self._streams:
            return self._in(self.stub.SubmitResult(messages, metadata=self.metadata,
                                                   timeout=TRANSFER_S))

    def updates(self, since_round: int, tier: int, wait_s: float) -> list[pb.UpdateMessage]:
        with self._streams:
            return [self._in(m) for m in self.stub.GetUpdates(self._out(pb.GetUpdatesRequest(
                since_round=since_round, tier=tier, wait_seconds=wait_s)),
                metadata=self.metadata, timeout=wait_s + TRANSFER_S)]

    def checkpoint(self) -> pb.CheckpointRef:
        return self._in(self.stub.GetCheckpoint(self._out(pb.GetCheckpointRequest()),
                                                metadata=self.metadata, timeout=CALL_S))

    def download(self, path: str, dest: Path) -> str:
        """A file of the root's checkpoint directory to ``dest`` (atomically); its sha256."""
        with self._streams:
            chunks = self.stub.DownloadCheckpoint(self._out(pb.DownloadCheckpointRequest(
                path=path)), metadata=self.metadata, timeout=TRANSFER_S)
            return receive_file(map(self._in, chunks), dest)

    def leave(self, reason: str) -> None:
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
