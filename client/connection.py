"""The client's end of the coordinator protocol (protocol/matformer/v1/coordinator.proto).

    connection = Connection("127.0.0.1:7070")            # tls_ca=Path(...) for TLS
    reply = connection.join(request)                     # remembers the session token
    connection.get_round(); connection.fetch_sequences(ids); connection.submit(header, results)
    connection.updates(since_round); connection.download(path, dest, sha256); connection.leave()

A call the network lost (``UNAVAILABLE``: the coordinator restarting, a dropped link) is
retried with exponential backoff and jitter for up to ``patience_s``; any other status is
the coordinator's answer and surfaces at once as ``Refused`` carrying the gRPC code and its
message. ``CheckpointFiles`` is the repository the checkpoint loader reads through: the run's
checkpoint files, downloaded once into a local cache and checked against the manifest.
"""

from __future__ import annotations

import random
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch

from client.errors import ClientError, DamagedOnServer, DamagedTransfer
from modeling.checkpoint.files import read_json
from modeling.checkpoint.manifest import MANIFEST_NAME, Manifest, sha256_of
from modeling.checkpoint.repository import normalize
from modeling.compression import RoundUpdate, SparseResult
from modeling.errors import MatformerError
from protocol.auth import session_metadata
from protocol.channel import GRPC_OPTIONS
from protocol.errors import ChecksumMismatch, MalformedStream
from protocol.files import receive_file
from protocol.link import metered
from protocol.matformer.v1 import coordinator_pb2 as pb
from protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from protocol.submission import submission_messages
from protocol.tensors import decode_tensor
from protocol.updates import read_updates

T = TypeVar("T")
RETRY_FIRST_S = 0.2  # first backoff; doubles per attempt up to RETRY_MAX_S, with jitter
RETRY_MAX_S = 5.0
DOWNLOAD_ATTEMPTS = 3  # of a checkpoint file that arrives damaged, before giving up


class Refused(ClientError):
    """The coordinator answered a call with an error status (``code``, and its message)."""

    def __init__(self, call: str, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{call} refused with {code.name}: {details}")
        self.call = call
        self.code = code
        self.details = details


class Unreachable(ClientError):
    """The coordinator did not answer within the connection's patience."""


class Connection:
    def __init__(self, address: str, *, tls_ca: Path | None = None, latency_s: float = 0.0,
                 bandwidth_mbit: float = 0.0, patience_s: float = 60.0) -> None:
        """``latency_s`` delays every call by that much and ``bandwidth_mbit`` limits each
        direction (local-testnet's simulated WAN; 0: no limit)."""
        if tls_ca is not None:
            credentials = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes())
            self.channel = grpc.secure_channel(address, credentials, options=GRPC_OPTIONS)
        else:
            self.channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        # every message counted each way (``meter``), and held to bandwidth_mbit if set
        self.channel, self.meter = metered(self.channel, mbit_per_s=bandwidth_mbit)
        self.address = address
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        self.latency_s = latency_s
        self.patience_s = patience_s
        self.metadata: tuple[tuple[str, str], ...] = ()
        self.call_seconds: Counter[str] = Counter()  # RPC name → seconds in its calls
        self.update_bytes = 0  # received in GetUpdates messages

    def close(self) -> None:
        self.channel.close()

    # -- the RPCs -----------------------------------------------------------------------

    def join(self, request: pb.JoinRequest, previous_session: str | None = None
             ) -> pb.JoinReply:
        """Join; ``previous_session`` (the token this client held before a restart) proves
        it is the member of that session, so it takes its name back without waiting."""
        metadata = session_metadata(previous_session) if previous_session else ()
        reply = self._call("Join", lambda: self.stub.Join(request, metadata=metadata))
        self.metadata = session_metadata(reply.session_token)
        return reply

    def heartbeat(self, round_index: int, tokens_per_second: float | None = None, *,
                  patience_s: float | None = None) -> pb.HeartbeatReply:
        request = pb.HeartbeatRequest(round=round_index)
        if tokens_per_second is not None:
            request.tokens_per_second = tokens_per_second
        return self._call("Heartbeat",
                          lambda: self.stub.Heartbeat(request, metadata=self.metadata),
                          patience_s=patience_s)

    def get_round(self) -> pb.RoundAssignment:
        return self._call("GetRound", lambda: self.stub.GetRound(pb.GetRoundRequest(),
                                                                  metadata=self.metadata))

    def fetch_sequences(self, ids: Sequence[int]) -> list[torch.Tensor]:
        """The token ids of ``ids``, in that order, as 1-D int64 tensors."""

        def fetch() -> list[torch.Tensor]:
            stream = self.stub.FetchSequences(pb.FetchSequencesRequest(ids=list(ids)),
                                              metadata=self.metadata)
            got = {m.id: decode_tensor(m.tokens, f"sequence {m.id}").long() for m in stream}
            missing = [i for i in ids if i not in got]
            if missing:
                raise Refused("FetchSequences", grpc.StatusCode.DATA_LOSS,
                              f"sequences {missing[:5]} did not arrive.")
            return [got[i] for i in ids]

        return self._call("FetchSequences", fetch)

    def submit(self, header: pb.SubmitHeader, results: Sequence[SparseResult]
               ) -> tuple[int, int]:
        """Stream one round's results: (results accepted, bytes sent)."""
        sent = 0

        def counted() -> Iterator[pb.SubmitMessage]:
            nonlocal sent
            sent = 0
            for message in submission_messages(header, results):
                sent += message.ByteSize()
                yield message

        accepted = self._call("SubmitResult", lambda: self.stub.SubmitResult(
            counted(), metadata=self.metadata).accepted)
        return accepted, sent

    def updates(self, since_round: int, tier: int) -> list[RoundUpdate]:
        """The logged round updates from ``since_round`` to the last completed round, cut to
        this client's ``tier``; ``update_bytes`` counts their messages (before gRPC's gzip on
        the wire)."""

        def counted(stream: Iterator[pb.UpdateMessage]) -> Iterator[pb.UpdateMessage]:
            for message in stream:
                self.update_bytes += message.ByteSize()
                yield message

        return self._call("GetUpdates", lambda: list(read_updates(counted(self.stub.GetUpdates(
            pb.GetUpdatesRequest(since_round=since_round), metadata=self.metadata)), tier)))

    def get_checkpoint(self) -> pb.CheckpointRef:
        """The coordinator's latest checkpoint, with the manifest entry for this client's tier."""
        return self._call("GetCheckpoint", lambda: self.stub.GetCheckpoint(
            pb.GetCheckpointRequest(), metadata=self.metadata))

    def download(self, path: str, dest: Path, sha256: str | None = None) -> str:
        """A file of the run's checkpoint directory to ``dest`` (atomically); its sha256."""
        return self._call("DownloadCheckpoint", lambda: receive_file(self.stub.DownloadCheckpoint(
            pb.DownloadCheckpointRequest(path=path), metadata=self.metadata), dest, sha256))

    def leave(self, reason: str) -> None:
        self._call("Leave", lambda: self.stub.Leave(pb.LeaveRequest(reason=reason),
                                                    metadata=self.metadata))

    # -- retries ------------------------------------------------------------------------

    def _call(self, name: str, action: Callable[[], T], *, patience_s: float | None = None
              ) -> T:
        patience_s = self.patience_s if patience_s is None else patience_s
        give_up = time.monotonic() + patience_s
        backoff = RETRY_FIRST_S
        while True:
            start = time.perf_counter()
            if self.latency_s:
                time.sleep(self.latency_s)
            try:
                return action()
            except grpc.RpcError as err:
                code = err.code()
                if code != grpc.StatusCode.UNAVAILABLE:
                    raise Refused(name, code, err.details() or "") from None
                if time.monotonic() + backoff > give_up:
                    raise Unreachable(
                        f"the coordinator at {self.address} did not answer {name} for "
                        f"{patience_s:.0f} s ({err.details()}); check --server and that "
                        "matformer-server is running.") from None
            finally:
                self.call_seconds[name] += time.perf_counter() - start
            time.sleep(backoff * random.uniform(0.5, 1.5))
            backoff = min(backoff * 2, RETRY_MAX_S)


class CheckpointFiles:
    """The run's ``checkpoints/`` directory as a repository for the checkpoint loader.

    ``fetch(path)`` answers a local copy under ``cache``: a cached file whose sha256 the
    manifest confirms, else one from ``mirror`` (a local folder or hub repository holding a
    copy of the run's checkpoints) that the manifest confirms, else a download from the
    coordinator. The manifest itself always comes from the coordinator. The loader checks
    every sha256 again before use. A download that arrives damaged (its sha256 is not the
    announced or the manifest's one, or it is cut short) is refused and fetched again, up to
    ``DOWNLOAD_ATTEMPTS`` times; each retry goes to ``log``.
    """

    def __init__(self, connection: Connection, cache: Path, mirror: Any | None = None,
                 log: Callable[[str], None] = lambda line: None) -> None:
        self.connection = connection
        self.log = log
        self.cache = Path(cache)
        self.mirror = mirror
        self.expected: dict[str, str] = {}
        self.downloaded: list[str] = []  # paths that came over gRPC, for the log
        self.mirrored: list[str] = []  # paths copied from the mirror

    def fetch(self, path: str) -> Path | None:
        local = self.cache / path
        if posix_name(path) == MANIFEST_NAME:
            if not self._download(path, local, None):
                return None
            manifest = Manifest.from_dict(read_json(local), f"the coordinator's {path}")
            folder = path.rpartition("/")[0]
            self.expected = {normalize(name, folder): digest
                             for name, digest in manifest.sha256.items()}
            return local
        wanted = self.expected.get(path)
        if wanted is not None and local.is_file() and sha256_of(local) == wanted:
            return local
        if wanted is not None and self.mirror is not None:
            found = self._from_mirror(path)
            if found is not None and sha256_of(found) == wanted:
                local.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(found, local)
                self.mirrored.append(path)
                return local
        return local if self._download(path, local, wanted) else None

    def _from_mirror(self, path: str) -> Path | None:
        try:
            return self.mirror.fetch(path)
        except (OSError, MatformerError):
            return None

    def _download(self, path: str, local: Path, sha256: str | None) -> bool:
        """Download ``path`` to ``local``; False if the coordinator does not serve it."""
        for attempt in range(1, DOWNLOAD_ATTEMPTS + 1):
            try:
                self.connection.download(path, local, sha256)
            except Refused as err:
                if err.code == grpc.StatusCode.NOT_FOUND:
                    return False
                if err.code == grpc.StatusCode.DATA_LOSS:
                    raise DamagedOnServer(
                        f"the coordinator will not send {path}: {err.details} Nothing was "
                        "kept; tell the run's operator, whose checkpoint on disk is damaged, "
                        "then run the client again.") from None
                raise
            except (ChecksumMismatch, MalformedStream) as err:
                damaged = err
                self.log(f"refused download {attempt} of {DOWNLOAD_ATTEMPTS} of {path}, it "
                         f"arrived damaged: {err}")
                continue
            self.downloaded.append(path)
            return True
        raise DamagedTransfer(
            f"{path} arrived damaged on all {DOWNLOAD_ATTEMPTS} downloads (the last: {damaged}) "
            "Something between the client and the coordinator corrupts data (a proxy, a faulty "
            "link), or the checkpoint was rewritten meanwhile: check the connection and run the "
            "client again.")


def posix_name(path: str) -> str:
    return path.rpartition("/")[2]
