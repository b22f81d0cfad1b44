"""scripts/fuzz_rpc.py with a small, seeded budget: every RPC survives random and mutated
requests, a refused call leaves the run as it was, and the run still completes a round."""

from __future__ import annotations

import grpc
import pytest

from protocol.auth import session_metadata
from protocol.channel import COORDINATOR_SERVICE, GRPC_OPTIONS
from protocol.errors import UnsafePath
from protocol.files import resolve_inside
from protocol.matformer.v1 import coordinator_pb2 as pb
from protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from scripts.fuzz_rpc import fuzz, fuzz_server, join_request, snapshot, valid_submission

EXAMPLES = 250
SECONDS = 20.0
@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    with fuzz_server(tmp_path_factory.mktemp("fuzz")) as server:
        yield server, fuzz(server, examples=EXAMPLES, seconds=SECONDS, seed=0)


def test_no_crash_and_no_change_on_refusal(fuzzed):
    _, report = fuzzed
    assert report.crashes == []
    assert report.state_changes == []
    assert report.tried == report.accepted + report.rejected >= 100
    assert report.accepted and report.rejected
    assert {rpc for rpc, _ in report.codes} == set(pb.DESCRIPTOR.services_by_name[
        "Coordinator"].methods_by_name)


def test_the_run_completes_a_round_afterwards(fuzzed):
    server, _ = fuzzed
    c = server.service.coordinator
    with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", options=GRPC_OPTIONS) as channel:
        stub = pb_grpc.CoordinatorStub(channel)
        for token in c.membership.sessions.as_dict().values():  # whoever the fuzzer left behind
            stub.Leave(pb.LeaveRequest(reason="fuzzing is over"), metadata=session_metadata(token))
        joined = [stub.Join(join_request(server, name)) for name in ("alice", "bob")]
        start = c.state.round
        for reply in joined:
            auth = session_metadata(reply.session_token)
            work = stub.GetRound(pb.GetRoundRequest(), metadata=auth)
            assert work.state == pb.ROUND_STATE_TRAIN
            messages = valid_submission(server, reply.client_id)
            assert stub.SubmitResult(iter(messages), metadata=auth).accepted == len(messages) - 1
        assert c.state.round == start + 1


def test_a_submission_cut_by_an_unparseable_message_keeps_nothing(tmp_path):
    """gRPC refuses a message it cannot parse and then ends the request stream as if it were
    complete; the results before it must not be kept."""
    with (fuzz_server(tmp_path) as server,
          grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel):
        stub = pb_grpc.CoordinatorStub(channel)
        joined = [stub.Join(join_request(server, name)) for name in ("alice", "bob")]
        blobs = [m.SerializeToString() for m in valid_submission(server, joined[0].client_id)]
        blobs[-1] = b"\xff"  # field 31, wire type 7: no message parses from it
        c = server.service.coordinator
        before = snapshot(server)
        submit = channel.stream_unary(f"/{COORDINATOR_SERVICE}/SubmitResult")
        with pytest.raises(grpc.RpcError) as err:
            submit(iter(blobs), metadata=session_metadata(joined[0].session_token))
        assert err.value.code() == grpc.StatusCode.INTERNAL
        assert c.state.round == 0 and snapshot(server) == before


def test_a_path_with_a_nul_is_refused_as_unsafe(tmp_path):
    """Found by the fuzzer: DownloadCheckpoint("round-0/\\x00") ended UNKNOWN (ValueError)."""
    with pytest.raises(UnsafePath, match="NUL"):
        resolve_inside(tmp_path, "round-0/\x00")


def test_an_overlong_path_is_refused_as_unsafe(tmp_path):
    with pytest.raises(UnsafePath, match="longer than any checkpoint"):
        resolve_inside(tmp_path, "a" * 4096)
    with pytest.raises(UnsafePath):
        resolve_inside(tmp_path, "round-0/" + "b" * 300)
