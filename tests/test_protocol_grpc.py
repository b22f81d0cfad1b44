"""The protocol over a real gRPC server on loopback, with a tiny fake Coordinator."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from matformer.modeling.compression import (
    CompressionConfig,
    RoundUpdate,
    SparseResult,
    UpdateConfig,
)
from matformer.protocol.auth import (
    SessionTokens,
    check_join_token,
    require_session,
    session_metadata,
    with_session,
)
from matformer.protocol.channel import COORDINATOR_SERVICE, GRPC_OPTIONS
from matformer.protocol.errors import ProtocolError
from matformer.protocol.files import receive_file, resolve_inside, send_file
from matformer.protocol.health import add_health
from matformer.protocol.link import Bucket, metered
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.protocol.sparse import ResultLayout, encode_sparse_result, result_layouts
from matformer.protocol.submission import read_results, read_submission, submission_messages
from matformer.protocol.updates import read_updates, update_messages
from matformer.server.aggregation import aggregate
from matformer.server.update_steps import update_step

JOIN_TOKEN = "join-secret"
MANIFEST = "round-2/matformer_manifest.json"


class FakeCoordinator(pb_grpc.CoordinatorServicer):
    """Just enough of a coordinator to exercise every helper the real one will use."""

    def __init__(self, checkpoints: Path) -> None:
        self.checkpoints = checkpoints
        self.sessions = SessionTokens()
        self.received: list[SparseResult] = []
        self.updates: list[RoundUpdate] = []

    def Join(self, request, context):
        check_join_token(context, request.join_token, JOIN_TOKEN)
        tier = request.capabilities.requested_tier
        client_id = f"{request.client_name}-1"
        return pb.JoinReply(
            client_id=client_id, session_token=self.sessions.issue(client_id), tier=tier,
            ffn_width=64 >> tier, tier_reason=f"requested tier {tier} fits", round=3,
            checkpoint=pb.CheckpointRef(round=2, manifest_path=MANIFEST, entry=pb.TierEntry(
                tier=str(tier), intermediate_size=64 >> tier, files=["model.safetensors"])),
        )

    def Heartbeat(self, request, context):
        require_session(context, self.sessions)
        return pb.HeartbeatReply(round=request.round + 1)

    def SubmitResult(self, request_iterator, context):
        client_id = require_session(context, self.sessions)
        try:
            header, rest = read_submission(request_iterator)
            if header.client_id != client_id:
                context.abort(grpc.StatusCode.PERMISSION_DENIED, "not your session")
            self.received = list(read_results(rest, _layouts()))
        except ProtocolError as err:
            context.abort(err.code, str(err))
        return pb.SubmitReply(accepted=len(self.received))

    def GetUpdates(self, request, context):
        require_session(context, self.sessions)
        yield from update_messages(u for u in self.updates if u.round > request.since_round)

    def DownloadCheckpoint(self, request, context):
        require_session(context, self.sessions)
        try:
            path = resolve_inside(self.checkpoints, request.path)
        except ProtocolError as err:
            context.abort(err.code, str(err))
        yield from send_file(path)

    def Leave(self, request, context):
        self.sessions.revoke(require_session(context, self.sessions))
        return pb.LeaveReply()


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[FakeCoordinator, grpc.Channel]]:
    coordinator = FakeCoordinator(tmp_path_factory.mktemp("checkpoints"))
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    pb_grpc.add_CoordinatorServicer_to_server(coordinator, server)
    add_health(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    yield coordinator, channel
    channel.close()
    server.stop(grace=None)


def _join(channel: grpc.Channel, join_token: str = JOIN_TOKEN) -> pb.JoinReply:
    return pb_grpc.CoordinatorStub(channel).Join(pb.JoinRequest(
        run_id="run-1", join_token=join_token, client_name="laptop",
        capabilities=pb.Capabilities(device_kind="cpu", device_name="x86", memory_bytes=8 << 30,
                                     requested_tier=1, tokens_per_second=1500.0,
                                     load_strategy="auto"),
        schema=pb.Schema(local_hash="l" * 64, canonical_hash="c" * 64, parameter_count=10**6,
                         tier=1, sliced=True),
    ), timeout=5)


def _authed(channel: grpc.Channel) -> tuple[pb.JoinReply, pb_grpc.CoordinatorStub]:
    reply = _join(channel)
    return reply, pb_grpc.CoordinatorStub(with_session(channel, reply.session_token))


DCT = CompressionConfig(encoding="dct", chunk=4, topk=3).build()
DENSE = CompressionConfig(encoding="dense").build()
FFN = [f"model.layers.{i}.mlp.up_proj.weight" for i in range(3)]


def _layouts() -> dict[str, ResultLayout]:
    """What the fake run takes from a tier-1 client: ``_results``' parameters, and the
    dense 256 × 256 w0..w7 of the throttled upload."""
    wide = [f"w{i}" for i in range(8)]
    return {**result_layouts(DCT, dict.fromkeys(FFN, (16, 6)),
                             dict.fromkeys(FFN, ((0, 8), (0, 6)))),
            **result_layouts(DENSE, {"model.norm.weight": (6,), **dict.fromkeys(wide, (256, 256))},
                             {"model.norm.weight": ((0, 6),),
                              **dict.fromkeys(wide, ((0, 256), (0, 256)))})}


def _results() -> list[SparseResult]:
    """A tier-1 client's results: DCT-compressed FFN slices and a dense norm."""
    dct, dense = DCT, DENSE
    return [
        dct.encode(f"model.layers.{i}.mlp.up_proj.weight", torch.randn(8, 6), shape=(16, 6),
                   region=((0, 8), (0, 6)), tokens=256)
        for i in range(3)
    ] + [dense.encode("model.norm.weight", torch.randn(6), shape=(6,), region=((0, 6),),
                      tokens=256)]


def test_join_round_trip(served) -> None:
    _, channel = served
    reply = _join(channel)
    assert (reply.client_id, reply.tier, reply.ffn_width, reply.round) == ("laptop-1", 1, 32, 3)
    assert reply.tier_reason == "requested tier 1 fits"
    assert reply.checkpoint.manifest_path == MANIFEST and reply.checkpoint.entry.tier == "1"
    assert reply.session_token.startswith("laptop-1.")


def test_wrong_join_token_is_unauthenticated(served) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        _join(served[1], join_token="guess")
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_missing_or_forged_session_token_is_unauthenticated(served) -> None:
    _, channel = served
    reply, stub = _authed(channel)
    assert stub.Heartbeat(pb.HeartbeatRequest(round=3), timeout=5).round == 4
    bare = pb_grpc.CoordinatorStub(channel)
    forged = reply.client_id + ".not-the-secret"
    for metadata in (None, session_metadata(forged), session_metadata("")):
        with pytest.raises(grpc.RpcError) as caught:
            bare.Heartbeat(pb.HeartbeatRequest(), metadata=metadata, timeout=5)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as caught:  # a streaming RPC is guarded the same way
        list(bare.DownloadCheckpoint(pb.DownloadCheckpointRequest(path=MANIFEST), timeout=5))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_token_stops_working_after_leave(served) -> None:
    _, stub = _authed(served[1])
    stub.Leave(pb.LeaveRequest(reason="done"), timeout=5)
    with pytest.raises(grpc.RpcError) as caught:
        stub.Heartbeat(pb.HeartbeatRequest(), timeout=5)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_submit_result_streams_several_sparse_results(served) -> None:
    coordinator, channel = served
    reply, stub = _authed(channel)
    results = _results()
    header = pb.SubmitHeader(round=3, client_id=reply.client_id, tokens=256, loss=3.2)
    assert stub.SubmitResult(submission_messages(header, results), timeout=5).accepted == 4
    assert [encode_sparse_result(r) for r in coordinator.received] == [
        encode_sparse_result(r) for r in results]


def test_a_malformed_result_is_invalid_argument(served) -> None:
    coordinator, channel = served
    reply, stub = _authed(channel)
    coordinator.received = []
    bad = _results()[0]
    bad.values[0, 0] = float("nan")  # the client's gradient diverged
    header = pb.SubmitHeader(round=3, client_id=reply.client_id)
    with pytest.raises(grpc.RpcError) as caught:
        stub.SubmitResult(submission_messages(header, [_results()[1], bad]), timeout=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "NaN" in caught.value.details() and coordinator.received == []


def test_get_updates_since_a_round(served) -> None:
    coordinator, channel = served
    _, stub = _authed(channel)
    norm = _results()[3]
    rule = UpdateConfig(rule="sgd", lr=0.01)
    step, _ = update_step(rule.build(), aggregate([norm]), [norm.region])
    coordinator.updates = [RoundUpdate(round=r, update=rule, steps={norm.name: step},
                                       hashes={1: f"{r:064x}"}) for r in (1, 2, 3)]
    received = list(read_updates(stub.GetUpdates(pb.GetUpdatesRequest(since_round=1), timeout=5),
                                 tier=1))
    assert [(u.round, u.hashes) for u in received] == [(2, {1: f"{2:064x}"}),
                                                      (3, {1: f"{3:064x}"})]
    for update in received:
        assert torch.equal(update.steps[norm.name].values, step.values)


def test_checkpoint_file_streams_in_chunks_with_sha256(served, tmp_path: Path) -> None:
    coordinator, channel = served
    _, stub = _authed(channel)
    data = os.urandom(5 * 1024 * 1024)
    source = coordinator.checkpoints / "round-2" / "model.safetensors"
    source.parent.mkdir(exist_ok=True)
    source.write_bytes(data)
    request = pb.DownloadCheckpointRequest(path="round-2/model.safetensors")
    sizes = [len(chunk.data) for chunk in stub.DownloadCheckpoint(request, timeout=10)]
    assert sizes == [2 << 20, 2 << 20, 1 << 20]
    dest = tmp_path / "model.safetensors"
    digest = receive_file(stub.DownloadCheckpoint(request, timeout=10), dest)
    assert digest == hashlib.sha256(data).hexdigest() and dest.read_bytes() == data
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.DownloadCheckpoint(pb.DownloadCheckpointRequest(path="../x"), timeout=5))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_health_reports_serving(served) -> None:
    health = health_pb2_grpc.HealthStub(served[1])
    for service in ("", COORDINATOR_SERVICE):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("direction", ["download", "upload"])
def test_a_throttled_channel_moves_data_at_its_bandwidth(served, tmp_path: Path, direction):
    """``--bandwidth-mbit``: a transfer is never faster than the limit. (How exactly the link
    spaces messages is the bucket's test below, on a fake clock: a busy machine only makes a
    real transfer slower, so its lower bound would measure the machine, not the link.)"""
    coordinator, channel = served
    reply, _ = _authed(channel)
    limit_mbit = 40.0
    link, meter = metered(channel, mbit_per_s=limit_mbit)
    slow = pb_grpc.CoordinatorStub(link)
    auth = session_metadata(reply.session_token)
    if direction == "download":
        source = coordinator.checkpoints / "round-9" / "model.safetensors"
        source.parent.mkdir(exist_ok=True)
        source.write_bytes(os.urandom(4 << 20))
        request = pb.DownloadCheckpointRequest(path="round-9/model.safetensors")
        start = time.perf_counter()
        moved = sum(m.ByteSize() for m in slow.DownloadCheckpoint(request, metadata=auth,
                                                                   timeout=30))
    else:
        compressor = CompressionConfig(encoding="dense").build()
        results = [compressor.encode(f"w{i}", torch.randn(256, 256), shape=(256, 256),
                                     region=((0, 256), (0, 256)), tokens=1) for i in range(8)]
        messages = list(submission_messages(pb.SubmitHeader(round=0, client_id=reply.client_id,
                                                            tokens=1), results))
        start = time.perf_counter()
        assert slow.SubmitResult(iter(messages), metadata=auth, timeout=30).accepted == 8
        moved = sum(m.ByteSize() for m in messages)
    seconds = time.perf_counter() - start
    assert moved > 2 << 20
    assert (meter.bytes_down if direction == "download" else meter.bytes_up) == moved
    assert moved * 8 / 1e6 / seconds <= 1.05 * limit_mbit, (moved, seconds)


def test_a_bucket_spaces_messages_by_their_size():
    now, slept = [0.0], []

    def sleep(s):
        slept.append(round(s, 6))
        now[0] += s

    bucket = Bucket(1000.0, clock=lambda: now[0], sleep=sleep)
    for size in (500, 500, 2000):
        bucket.take(size)
    now[0] += 10.0  # an idle link saves nothing up: no burst after a pause
    bucket.take(1000)
    assert slept == [0.5, 0.5, 2.0, 1.0] and bucket.carried == 4000
