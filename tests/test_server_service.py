"""matformer-server end to end on loopback: a real gRPC client through the stubs, real HTTP."""

from __future__ import annotations

import hashlib
import http.client
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.helpers import served_run_toml
from support.rounds import committed, flat_results
from support.wire import code_of, http_get, join_request, schema_hash

from matformer.modeling.checkpoint.manifest import MANIFEST_NAME
from matformer.protocol.auth import session_metadata
from matformer.protocol.channel import COORDINATOR_SERVICE, GRPC_OPTIONS
from matformer.protocol.files import receive_file
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.protocol.submission import submission_messages
from matformer.protocol.tensors import decode_tensor
from matformer.protocol.updates import read_updates
from matformer.server.config import RunConfig
from matformer.server.main import RunningServer, main


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    config = RunConfig.load(served_run_toml(tmp_path_factory.mktemp("svc")))
    server = RunningServer.start(config, grpc_port=0, http_port=0)
    assert server.wait_until_http_ready()
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", options=GRPC_OPTIONS)
    yield server, pb_grpc.CoordinatorStub(channel), channel
    channel.close()
    server.stop()


def test_join_rejections(running):
    server, stub, _ = running
    code, details = code_of(lambda: stub.Join(join_request(server, token="wrong")))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    code, details = code_of(lambda: stub.Join(join_request(server, schema="f" * 64)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "f" * 64 in details and schema_hash(server) in details
    assert server.service.coordinator.membership.members == {}


SESSION_CALLS = [("GetRound", pb.GetRoundRequest()), ("Heartbeat", pb.HeartbeatRequest()),
                 ("FetchSequences", pb.FetchSequencesRequest(ids=[0])),
                 ("GetUpdates", pb.GetUpdatesRequest()), ("Leave", pb.LeaveRequest())]


@pytest.mark.parametrize("metadata", [(), session_metadata("client-0.not-the-secret")],
                         ids=["missing", "forged"])
@pytest.mark.parametrize("method,request_", SESSION_CALLS, ids=[m for m, _ in SESSION_CALLS])
def test_sessions_are_required(running, method, request_, metadata):
    _, stub, _ = running

    def call():
        reply = getattr(stub, method)(request_, metadata=metadata)
        return list(reply) if method in ("FetchSequences", "GetUpdates") else reply

    assert code_of(call)[0] == grpc.StatusCode.UNAUTHENTICATED


def test_a_run_over_grpc_and_http(running, tmp_path):
    server, stub, channel = running
    c = server.service.coordinator
    alice = stub.Join(join_request(server))
    assert alice.tier == 0 and alice.ffn_width == 64 and alice.tier_reason
    assert alice.settings.encoding == "dense"
    auth_a = session_metadata(alice.session_token)
    waiting = stub.GetRound(pb.GetRoundRequest(), metadata=auth_a)
    assert waiting.state == pb.ROUND_STATE_WAIT  # min_clients = 2

    bob = stub.Join(join_request(server, name="bob"))
    auth_b = session_metadata(bob.session_token)
    work = stub.GetRound(pb.GetRoundRequest(), metadata=auth_a)
    assert work.state == pb.ROUND_STATE_TRAIN and work.round == 0 and work.sequence_ids

    sequences = list(stub.FetchSequences(pb.FetchSequencesRequest(ids=work.sequence_ids),
                                         metadata=auth_a))
    assert [s.id for s in sequences] == list(work.sequence_ids)
    assert torch.equal(decode_tensor(sequences[0].tokens),
                       torch.from_numpy(c.reader[work.sequence_ids[0]].copy()))
    assert code_of(lambda: list(stub.FetchSequences(
        pb.FetchSequencesRequest(ids=[10**9]), metadata=auth_a)))[0] == (
        grpc.StatusCode.INVALID_ARGUMENT)

    # A NaN in a result: INVALID_ARGUMENT, and neither the master nor the round changes.
    before = {n: t.clone() for n, t in c.master.items()}
    bad = flat_results(c, alice.client_id, poison=True)
    header = pb.SubmitHeader(round=0, client_id=alice.client_id, tokens=1, loss=3.0,
                             assignment_id=work.assignment_id)
    code, details = code_of(lambda: stub.SubmitResult(submission_messages(header, bad),
                                                      metadata=auth_a))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "NaN" in details
    assert all(torch.equal(before[n], c.master[n]) for n in before)
    assert c.current_round.submissions == {}
    # Someone else's client id in the header: refused too.
    code, _ = code_of(lambda: stub.SubmitResult(
        submission_messages(pb.SubmitHeader(round=0, client_id=bob.client_id, loss=3.0),
                            flat_results(c, alice.client_id)), metadata=auth_a))
    assert code == grpc.StatusCode.PERMISSION_DENIED

    for reply, auth, loss in ((alice, auth_a, 3.0), (bob, auth_b, 4.0)):
        good = flat_results(c, reply.client_id)
        assigned = stub.GetRound(pb.GetRoundRequest(), metadata=auth).assignment_id
        header = pb.SubmitHeader(round=0, client_id=reply.client_id, loss=loss,
                                 assignment_id=assigned)
        accepted = stub.SubmitResult(submission_messages(header, good), metadata=auth)
        assert accepted.accepted == len(good)
    committed(c, 1)
    assert c.state.round == 1 and not all(torch.equal(before[n], c.master[n]) for n in before)
    stale = stub.SubmitResult
    assert code_of(lambda: stale(submission_messages(
        pb.SubmitHeader(round=0, client_id=alice.client_id, loss=1.0),
        flat_results(c, alice.client_id)), metadata=auth_a))[0] == grpc.StatusCode.INVALID_ARGUMENT

    (update,) = read_updates(stub.GetUpdates(pb.GetUpdatesRequest(since_round=0),
                                             metadata=auth_a), tier=0)
    assert update.round == 0 and update.hashes == c.tier_hashes([0])
    assert set(update.steps) == set(c.shapes)
    # A replica at another of the run's tiers (its member just moved, and its updates were
    # asked for ahead) gets them cut to that tier, with that tier's hash; a tier the run
    # lacks is refused
    (cut,) = read_updates(stub.GetUpdates(pb.GetUpdatesRequest(since_round=0, tier=1),
                                          metadata=auth_a), tier=1)
    assert cut.hashes == c.tier_hashes([1]) != update.hashes
    assert any(cut.steps[n].box != update.steps[n].box for n in update.steps)  # narrower FFN
    code, details = code_of(lambda: list(stub.GetUpdates(
        pb.GetUpdatesRequest(since_round=0, tier=7), metadata=auth_a)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "tier 7" in details

    manifest = tmp_path / "manifest.json"
    receive_file(stub.DownloadCheckpoint(pb.DownloadCheckpointRequest(
        path=alice.checkpoint.manifest_path), metadata=auth_a), manifest)
    assert json.loads(manifest.read_text())["tiers"]
    for path, code in (("../state.json", grpc.StatusCode.INVALID_ARGUMENT),
                       ("round-0/nothing", grpc.StatusCode.NOT_FOUND)):
        assert code_of(lambda path=path: list(stub.DownloadCheckpoint(
            pb.DownloadCheckpointRequest(path=path), metadata=auth_a)))[0] == code

    status, body = http_get(server, "/status")
    report = json.loads(body)
    assert status == 200 and report["run_id"] == "svc-test" and report["round"] == 1
    assert {m["name"]: m["tier"] for m in report["clients"]} == {"alice": 0, "bob": 0}
    (point,) = report["loss"]["0"]
    assert point["round"] == 0 and 3.0 < point["loss"] < 4.0  # token-weighted mean
    assert report["bytes_received"]["0"] > 0
    status, body = http_get(server, "/metrics")
    assert status == 200 and 'matformer_rounds_total{run="svc-test"} 1' in body.decode()
    assert "# TYPE matformer_rounds_total counter" in body.decode()
    assert "# TYPE matformer_tokens_total counter" in body.decode()
    assert f'matformer_loss{{run="svc-test",tier="0"}} {point["loss"]}' in body.decode()
    status, body = http_get(server, f"/files/{alice.checkpoint.manifest_path}")
    assert status == 200 and body == manifest.read_bytes()
    assert http_get(server, "/files/../state.json")[0] == 404
    assert http_get(server, "/files/%2e%2e/state.json")[0] == 404

    stub.Leave(pb.LeaveRequest(reason="done"), metadata=auth_b)
    assert code_of(lambda: stub.Heartbeat(pb.HeartbeatRequest(), metadata=auth_b))[0] == (
        grpc.StatusCode.UNAUTHENTICATED)
    health = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=COORDINATOR_SERVICE))
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def http_head(server, path: str) -> tuple[int, http.client.HTTPMessage, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=5)
    try:
        connection.request("HEAD", path)
        reply = connection.getresponse()
        return reply.status, reply.headers, reply.read()
    finally:
        connection.close()


def test_head_on_files_answers_like_get_without_the_body(running):
    server, *_ = running
    folder = f"round-{server.service.coordinator.state.checkpoints[-1]}"
    manifest = f"{folder}/{MANIFEST_NAME}"
    served = server.coordinator.checkpoints.root
    listed = sorted(json.loads((served / manifest).read_text())["sha256"])
    for path in (manifest, f"{folder}/{listed[0]}"):
        status, body = http_get(server, f"/files/{path}")
        head_status, headers, head_body = http_head(server, f"/files/{path}")
        assert (status, head_status, head_body) == (200, 200, b""), path
        assert int(headers["Content-Length"]) == len(body)
        assert headers["X-Checksum-Sha256"] == (
            None if path == manifest else hashlib.sha256(body).hexdigest())
    for path in ("round-0/nothing", "../state.json"):
        assert http_head(server, f"/files/{path}")[::2] == (404, b""), path


def test_main_reports_a_bad_config(tmp_path, capsys):
    assert main(["--config", str(tmp_path / "missing.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_main_refuses_a_model_smaller_than_its_datas_vocabulary(tmp_path, capsys):
    """Issue 32: a [data] strategy whose ids outgrow [model] vocab_size is refused at start,
    in one line naming both sizes, not at the first round's embedding lookup."""
    import dataclasses

    from support.helpers import run_tables, write_run_toml
    from support.models import tiny_config

    from matformer.modeling.mdat import build_default_mdat

    build_default_mdat(tmp_path / "docs.mdat", limit=5).close()  # bytes: 260 ids
    model = dataclasses.asdict(tiny_config(vocab_size=200, mask_token_id=199,
                                           max_position_embeddings=128))
    toml = write_run_toml(tmp_path / "run.toml", run_tables(
        "docs.mdat", model={"inline": {k: v for k, v in model.items() if v is not None}}))
    assert main(["--config", str(toml)]) == 2
    said = capsys.readouterr().err.strip()
    assert said.startswith("matformer-server: strategy 'bytes128' gives token ids up to 259 "
                           "(a vocabulary of 260), but the model's vocab_size is 200;")
    assert "\n" not in said
    assert not (tmp_path / "run" / "state.json").exists()


def test_submissions_are_decoded_a_few_at_a_time_and_all_are_kept(tmp_path, monkeypatch):
    """Six members upload at once; at most DECODERS of their submissions are decoded at a
    time (the rest wait their turn, not the GIL's), and every one is accepted."""
    import matformer.server.service as service_module

    members = 6
    config = RunConfig.load(served_run_toml(tmp_path, min_clients=members))
    server = RunningServer.start(config, grpc_port=0, http_port=0)
    decoding, most = [0], [0]
    guard = threading.Lock()
    decode = service_module.decode_screened

    def slow_decode(screened):
        with guard:
            decoding[0] += 1
            most[0] = max(most[0], decoding[0])
        try:
            time.sleep(0.2)  # long enough that uploads not held back would overlap here
            return decode(screened)
        finally:
            with guard:
                decoding[0] -= 1

    monkeypatch.setattr(service_module, "decode_screened", slow_decode)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", options=GRPC_OPTIONS)
    try:
        stub, c = pb_grpc.CoordinatorStub(channel), server.service.coordinator
        joined = [stub.Join(join_request(server, name=f"m{i}")) for i in range(members)]
        uploads = []
        for reply in joined:
            auth = session_metadata(reply.session_token)
            work = stub.GetRound(pb.GetRoundRequest(), metadata=auth)
            assert work.state == pb.ROUND_STATE_TRAIN
            header = pb.SubmitHeader(round=work.round, client_id=reply.client_id, loss=3.0,
                                     assignment_id=work.assignment_id)
            uploads.append((list(submission_messages(header, flat_results(
                c, reply.client_id))), auth))
        with ThreadPoolExecutor(members) as pool:
            accepted = list(pool.map(lambda u: stub.SubmitResult(
                iter(u[0]), metadata=u[1], timeout=60).accepted, uploads))
        assert accepted == [len(c.shapes)] * members
        assert 1 <= most[0] <= service_module.DECODERS < members
    finally:
        channel.close()
        server.stop()
