"""What one member's calls may hold of the server (issue 15, finding 3): worker threads (call
slots per member, stream slots overall, streams that wait on their peer ended), memory (a
submission's header checked before its results, one result per parameter at most) and work
(FetchSequences serves each assigned id once). Real servers on loopback, real gRPC stubs."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from support.helpers import JOIN_TOKEN, served_run_toml
from support.rounds import committed, flat_results
from support.wire import (
    HONEST_TIMEOUT_S,
    code_of,
    header_of,
    join_request,
    joined,
    serving,
    stalled,
    stalled_unary,
)

from matformer.client.connection import Connection
from matformer.modeling.compression import CompressionConfig
from matformer.protocol.auth import session_metadata
from matformer.protocol.channel import GRPC_OPTIONS
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.protocol.sparse import encode_sparse_result
from matformer.protocol.submission import submission_messages
from matformer.server.call_slots import CallLimits, CallSlots
from matformer.server.errors import NoStreamSlot, StaleRound, StreamIdle, TooManyCalls

# -- worker threads ----------------------------------------------------------------------------

def test_stalled_streams_do_not_starve_honest_heartbeats(tmp_path):
    with serving(tmp_path) as (server, stub):
        mallory, auth_m, work = joined(stub, server, "mallory")
        assert work.state == pb.ROUND_STATE_TRAIN  # its header passes every check
        _, auth_a, _ = joined(stub, server, "alice")
        release = threading.Event()
        calls = [stub.SubmitResult.future(stalled(header_of(mallory, work), release),
                                          metadata=auth_m) for _ in range(20)]
        try:
            time.sleep(1.0)  # every stream reaches the server (and takes a thread, if it can)
            reply = stub.Heartbeat(pb.HeartbeatRequest(), metadata=auth_a,
                                   timeout=HONEST_TIMEOUT_S)
            assert reply.round == 0
            stub.Join(join_request(server, name="carol"), timeout=HONEST_TIMEOUT_S)
            refused = [call for call in calls if call.done()]
            assert len(refused) == 17  # three streams per member at once
            assert {call.code() for call in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert any("3 streams in progress" in call.details() for call in refused)
        finally:
            for call in calls:
                call.cancel()
            release.set()


def test_calls_whose_request_never_arrives_do_not_starve_honest_members(tmp_path):
    with serving(tmp_path, CallLimits(request_s=2.0)) as (server, stub):
        _, auth_m, _ = joined(stub, server, "mallory")
        _, auth_a, _ = joined(stub, server, "alice")
        release = threading.Event()
        joins = stalled_unary(server, "Join", pb.JoinRequest, pb.JoinReply, release)
        beats = stalled_unary(server, "Heartbeat", pb.HeartbeatRequest, pb.HeartbeatReply,
                              release, metadata=auth_m)
        try:
            time.sleep(1.0)  # 40 calls: the pool has a thread for each, but no more may wait
            assert stub.Heartbeat(pb.HeartbeatRequest(), metadata=auth_a,
                                  timeout=HONEST_TIMEOUT_S).round == 0
            refused_joins = [c for c in joins if c.done()]
            refused_beats = [c for c in beats if c.done()]
            assert len(refused_joins) == 16 and len(refused_beats) == 16  # 4 of each wait
            assert {c.code() for c in refused_joins} == {grpc.StatusCode.UNAVAILABLE}
            assert "retry in a few seconds" in refused_joins[0].details()
            assert {c.code() for c in refused_beats} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
            assert "4 calls in progress" in refused_beats[0].details()
            # the waits end after request_idle_s, and the slots are free again
            waiting = [c for c in joins + beats if c not in refused_joins + refused_beats]
            assert {c.code() for c in waiting} == {grpc.StatusCode.DEADLINE_EXCEEDED}
            assert "waited 2 s for its peer" in waiting[0].details()
            assert stub.Join(join_request(server, name="carol"), timeout=HONEST_TIMEOUT_S)
        finally:
            release.set()


def test_a_stream_that_waits_on_its_peer_is_ended_with_its_reason(tmp_path):
    # a result awaited may take 1 s beyond what 1 MiB (the largest message) needs at 8 Mbit/s
    with serving(tmp_path, CallLimits(idle_s=1.0, message_bytes=2**20)) as (server, stub):
        mallory, auth, work = joined(stub, server, "mallory")
        release = threading.Event()
        call = stub.SubmitResult.future(stalled(header_of(mallory, work), release),
                                        metadata=auth, timeout=30)
        try:
            assert call.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "waited 2.05 s for its peer" in call.details()  # not the client's deadline
        finally:
            release.set()
        # nothing of it was kept, it is not counted, and the slot is free: a submission passes
        c = server.service.coordinator
        accepted = stub.SubmitResult(submission_messages(header_of(mallory, work),
                                                         flat_results(c, mallory.client_id)),
                                     metadata=auth, timeout=HONEST_TIMEOUT_S)
        assert accepted.accepted == len(c.shapes)
        committed(c, 1)


def test_call_slots_per_member_and_overall():
    slots = CallSlots(CallLimits(per_member=4, streams_per_member=2, streams=4))

    def fill() -> contextlib.ExitStack:
        """Two streams and a call of a's, and the last two stream slots, b's and c's."""
        held = contextlib.ExitStack()
        for member in ("a", "a", "b", "c"):
            held.enter_context(slots.stream(member, end=lambda err: None))
        held.enter_context(slots.call("a"))
        return held

    with fill():
        with pytest.raises(TooManyCalls, match="2 streams in progress"):
            slots.stream("a", end=lambda err: None).__enter__()
        with pytest.raises(NoStreamSlot, match="4 of the server's 4 shared stream slots"):
            slots.stream("d", end=lambda err: None).__enter__()
        with (slots.call("a"), slots.call("a"), slots.call("a"),  # streams take no call slot
              pytest.raises(TooManyCalls, match="4 calls in progress")):
            slots.call("a").__enter__()
        with slots.call("d"):  # a unary call needs no stream slot
            pass
    with fill():  # every slot was given back
        pass


def test_a_watch_ends_only_waits_on_the_peer():
    """Idle and past-the-end waits end the call with their error; the server's own work
    (between waits) never does."""
    slots = CallSlots(CallLimits(idle_s=0.2, message_bytes=0))
    ended: list[Exception] = []
    late = StaleRound("the round closed")

    def peer(delays: list[float]) -> Iterator[int]:
        for i, delay in enumerate(delays):
            time.sleep(delay)
            yield i

    with slots.stream("a", end=ended.append) as watch:
        for _ in watch.received(peer([0.0, 0.0])):
            time.sleep(0.3)  # working, not waiting: never ended
    assert ended == []
    with slots.stream("a", end=ended.append) as watch, pytest.raises(StreamIdle):
        list(watch.received(peer([0.0, 0.5])))
    assert isinstance(ended.pop(), StreamIdle)
    with slots.stream("a", end=ended.append) as watch, pytest.raises(StaleRound):
        watch.until(time.monotonic() + 0.1, late)
        for _ in watch.sent(iter([pb.FileChunk()] * 3)):
            time.sleep(0.15)  # the peer takes each message within idle_s, but past the end
    assert ended == [late]


# -- memory: the header first, one result per parameter at most -------------------------------

def test_a_header_is_checked_before_any_result_is_read(tmp_path):
    """A stale or repeated submission is refused for its header, though the results behind
    it would not even decode."""
    garbage = [pb.SparseResult()]  # no tensors: decoding it raises MalformedSparseResult
    with serving(tmp_path) as (server, stub):
        mallory, auth, work = joined(stub, server, "mallory")

        def submit(header: pb.SubmitHeader, results) -> tuple[grpc.StatusCode, str]:
            messages = [pb.SubmitMessage(header=header),
                        *(pb.SubmitMessage(result=r) for r in results)]
            return code_of(lambda: stub.SubmitResult(iter(messages), metadata=auth))

        code, details = submit(header_of(mallory, work, assignment_id="0.stale.x"), garbage)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "assignment" in details
        code, details = submit(header_of(mallory, work, round=7), garbage)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "round 7" in details
        c = server.service.coordinator
        good = [encode_sparse_result(r) for r in flat_results(c, mallory.client_id)]
        assert submit(header_of(mallory, work), good[:1] * 2)[0] == (
            grpc.StatusCode.INVALID_ARGUMENT)  # a result twice: the header was fine
        stub.SubmitResult(submission_messages(header_of(mallory, work),
                                              flat_results(c, mallory.client_id)),
                          metadata=auth)
        code, details = submit(header_of(mallory, work), garbage)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "round 0" in details


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def resident_bytes(pid: int) -> int:
    """The process's resident set (VmRSS in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for process {pid}")


def tiny_results(header: pb.SubmitHeader, count: int) -> Iterator[pb.SubmitMessage]:
    """A header and ``count`` valid one-value results under made-up names (~70 bytes each)."""
    one = CompressionConfig(encoding="dense").build().encode(
        "p", torch.zeros(1), shape=(1,), region=((0, 1),), tokens=1)
    template = encode_sparse_result(one)
    yield pb.SubmitMessage(header=header)
    for i in range(count):
        message = pb.SubmitMessage(result=template)
        message.result.name = f"p{i}"
        yield message


def test_a_stream_of_tiny_results_is_refused_early_with_bounded_memory(tmp_path):
    """200,000 tiny results (14 MB on the wire) decode to ~450 MiB of tensors: the server, a
    child process here, refuses the stream at the first result for a parameter the run does
    not have (and would at a parameter's second) and barely grows."""
    path = served_run_toml(tmp_path, min_clients=1)
    grpc_port, http_port = free_ports(2)
    with open(tmp_path / "server.log", "w") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "matformer.server.main", "--config", str(path),
             "--set", f"server.grpc_port={grpc_port}", "--set", f"server.http_port={http_port}"],
            stdout=log, stderr=subprocess.STDOUT)
    channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}", options=GRPC_OPTIONS)
    try:
        grpc.channel_ready_future(channel).result(timeout=120)
        stub = pb_grpc.CoordinatorStub(channel)
        join = pb.JoinRequest(run_id="svc-test", join_token="join-secret", client_name="mallory",
                              capabilities=pb.Capabilities(device_kind="cpu",
                                                           memory_bytes=2**34,
                                                           tokens_per_second=1000.0))
        mallory = stub.Join(join, timeout=60)
        auth = session_metadata(mallory.session_token)
        work = stub.GetRound(pb.GetRoundRequest(), metadata=auth)
        header = header_of(mallory, work)
        code_of(lambda: stub.SubmitResult(tiny_results(header, 1000), metadata=auth))  # warm up
        before = resident_bytes(child.pid)
        code, details = code_of(lambda: stub.SubmitResult(tiny_results(header, 200_000),
                                                          metadata=auth, timeout=300))
        grown = resident_bytes(child.pid) - before
        assert grown < 40 * 2**20, f"the server grew by {grown / 2**20:.0f} MiB"
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a parameter" in details
        stub.Heartbeat(pb.HeartbeatRequest(), metadata=auth, timeout=HONEST_TIMEOUT_S)
    finally:
        channel.close()
        child.terminate()
        child.wait(timeout=30)


# -- work: each assigned sequence once per request ---------------------------------------------

def test_fetch_sequences_serves_each_assigned_id_once(tmp_path):
    with serving(tmp_path) as (server, stub):
        _, auth, work = joined(stub, server, "mallory")
        ids = list(work.sequence_ids)

        def fetch(request_ids: list[int]) -> tuple[grpc.StatusCode, str]:
            return code_of(lambda: list(stub.FetchSequences(
                pb.FetchSequencesRequest(ids=request_ids), metadata=auth,
                timeout=HONEST_TIMEOUT_S)))

        code, details = fetch([ids[0]] * 200_000)
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"sequence ids [{ids[0]}] more than once (200000 ids, 1 distinct)" in details
        assert fetch(ids * 2)[0] == grpc.StatusCode.INVALID_ARGUMENT  # twice the assignment
        unassigned = next(i for i in range(len(server.service.coordinator.reader))
                          if i not in ids)
        code, details = fetch([*ids, unassigned])  # more ids than assigned, none repeated
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "assignment" in details
        served = stub.FetchSequences(pb.FetchSequencesRequest(ids=ids), metadata=auth)
        assert [s.id for s in served] == ids


def test_a_member_whose_assignment_repeats_an_id_asks_for_it_once(tmp_path):
    """A round can hand a member one id twice (the data is shorter than the round's budget,
    or an id handed back meets its next epoch): the member asks for each id once and trains
    the sequence twice, where it used to be refused and lose the round."""
    with serving(tmp_path) as (server, _):
        connection = Connection(f"127.0.0.1:{server.grpc_port}", patience_s=5.0)
        try:
            connection.join(name="alice", run_id="svc-test", join_token=JOIN_TOKEN,
                            device_kind="cpu", device_name="test", memory_bytes=2**34,
                            load_strategy="auto", microbatch_tokens=2048, tier=0)
            connection.heartbeat(0, tokens_per_second=1000.0)  # measured: ready for work
            ids = list(connection.get_round().sequence_ids)
            repeated = [ids[-1], *ids, ids[0]]
            got = connection.fetch_sequences(repeated)
        finally:
            connection.close()
        reader = server.service.coordinator.reader
        assert len(got) == len(repeated)
        for i, tokens in zip(repeated, got, strict=True):
            assert torch.equal(tokens, torch.from_numpy(reader[i].astype("int64")))
