"""A coalition of members at the per-member call limits cannot take the server from honest
members (issue 30, rows 6 and 7): a member with work in the open round always has a stream of
its own and the rest share the stream slots fairly; the pool has a thread for every call the
limits admit, so heartbeats never wait for one; a stream whose peer stops is ended within
seconds of what its message needs on a slow link. Real servers on loopback, real gRPC stubs."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from support.helpers import served_run_toml
from support.wire import header_of, join_request, joined, serving_config, stalled, stalled_unary

from matformer.protocol.auth import session_metadata
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.server.call_slots import CallLimits, CallSlots
from matformer.server.config import RunConfig
from matformer.server.errors import NoStreamSlot, StreamIdle
from matformer.server.main import RunningServer

COALITION = 8  # members, each holding its 4 calls: 2 streams and 2 calls with no request
SEQUENCE_TOKENS = 128  # helpers.run_tables' max_seq_len
PROMPT_S = 10.0  # what an honest call is given here: far more than it takes, far less than
# the coalition holds its calls


@contextlib.contextmanager
def served(tmp_path, *, min_clients: int, sequences: int, **faults: float
           ) -> Iterator[tuple[RunningServer, pb_grpc.CoordinatorStub]]:
    """A run whose round 0 opens once ``min_clients`` have joined, with ``sequences``
    sequences to share; long deadlines, so only the limits under test end a call."""
    rounds = {"min_clients": min_clients, "deadline_s": 300.0,
              "tokens_per_round": sequences * SEQUENCE_TOKENS, "rounds": 5}
    path = served_run_toml(tmp_path, round=rounds,
                           faults={"max_joins_per_minute": 1000, **faults})
    with serving_config(RunConfig.load(path)) as pair:
        yield pair


@contextlib.contextmanager
def held_by_coalition(tmp_path, *, bystanders: int = 0) -> Iterator[tuple]:
    """A served run where the coalition and "victim" join (round 0 opens with work for each
    of them), then ``bystanders`` members (without work); every coalition member then holds
    4 calls, its limit: 2 submissions that sent their header and stall, 2 heartbeats whose
    request never comes. Yields the server, a stub, the bystanders' and the victim's
    JoinReply, the victim's session and its assignment."""
    with served(tmp_path, min_clients=COALITION + 1, sequences=2 * (COALITION + 1),
                request_idle_s=300.0) as (server, stub):
        joins = [stub.Join(join_request(server, name=f"member-{i}"), timeout=PROMPT_S)
                 for i in range(COALITION + 1)]
        auths = [session_metadata(member.session_token) for member in joins]
        works = [stub.GetRound(pb.GetRoundRequest(), metadata=auth) for auth in auths]
        assert {work.state for work in works} == {pb.ROUND_STATE_TRAIN}
        others = [stub.Join(join_request(server, name=f"bystander-{i}"), timeout=PROMPT_S)
                  for i in range(bystanders)]
        release, calls = threading.Event(), []
        for member, auth, work in list(zip(joins, auths, works, strict=True))[:COALITION]:
            calls += [stub.SubmitResult.future(stalled(header_of(member, work), release),
                                               metadata=auth, timeout=300) for _ in range(2)]
            calls += stalled_unary(server, "Heartbeat", pb.HeartbeatRequest, pb.HeartbeatReply,
                                   release, metadata=auth, count=2, timeout=300)
        try:
            time.sleep(2.0)  # every call reaches the server and holds what it can
            assert not any(call.done() for call in calls)  # all within the limits
            yield server, stub, others, joins[-1], auths[-1], works[-1]
        finally:
            release.set()
            for call in calls:
                call.cancel()


def test_a_coalition_at_the_per_member_limits_leaves_an_honest_member_served(tmp_path):
    """Issue 30 row 6: 8 members' stalled streams held every stream slot, and a victim's
    FetchSequences, DownloadCheckpoint and GetUpdates got UNAVAILABLE."""
    with held_by_coalition(tmp_path) as (server, stub, _, victim, auth, work):
        prompt = {"metadata": auth, "timeout": PROMPT_S}
        fetched = stub.FetchSequences(pb.FetchSequencesRequest(ids=work.sequence_ids), **prompt)
        assert [sequence.id for sequence in fetched] == list(work.sequence_ids)
        manifest = pb.DownloadCheckpointRequest(path=victim.checkpoint.manifest_path)
        assert b"".join(chunk.data for chunk in stub.DownloadCheckpoint(manifest, **prompt))
        assert list(stub.GetUpdates(pb.GetUpdatesRequest(since_round=0), **prompt)) == []
        assert stub.Heartbeat(pb.HeartbeatRequest(), **prompt).round == 0
        # a member without work shares the slots the coalition left: it could not take them all
        late = stub.Join(join_request(server, name="late"), timeout=PROMPT_S)
        chunks = stub.DownloadCheckpoint(manifest, metadata=session_metadata(
            late.session_token), timeout=PROMPT_S)
        assert b"".join(chunk.data for chunk in chunks)


def test_every_heartbeat_is_answered_while_a_coalition_holds_its_calls(tmp_path):
    """Issue 30 row 7: heartbeats and GetRounds were answered UNAVAILABLE under load. 64
    members heartbeat at once, and ask for work, while the coalition holds all it may."""
    with held_by_coalition(tmp_path, bystanders=64) as (_, stub, members, *_):

        def beat(member: pb.JoinReply) -> tuple[int, int]:
            auth = session_metadata(member.session_token)
            reply = stub.Heartbeat(pb.HeartbeatRequest(), metadata=auth, timeout=PROMPT_S)
            work = stub.GetRound(pb.GetRoundRequest(), metadata=auth, timeout=PROMPT_S)
            return reply.round, work.state

        with ThreadPoolExecutor(len(members)) as pool:
            answers = list(pool.map(beat, members))
        assert answers == [(0, pb.ROUND_STATE_WAIT)] * 64  # round 0 is theirs to wait for


def test_a_stream_whose_peer_stops_is_ended_within_seconds(tmp_path):
    """A submission whose header never comes is ended after request_idle_s; one that stops
    after its header, once it has waited stream_idle_s (default 10 s) beyond what the largest
    message (1 MiB here) needs at 8 Mbit/s: both with the reason, not at the round's deadline
    or the former 120 s."""
    with served(tmp_path, min_clients=1, sequences=8, request_idle_s=3.0,
                max_message_mb=1.0) as (server, stub):
        member, auth, work = joined(stub, server, "mallory")
        release = threading.Event()
        try:
            silent = stalled_unary(server, "SubmitResult", pb.SubmitMessage, pb.SubmitReply,
                                   release, metadata=auth, count=1, timeout=60)[0]
            stopped = stub.SubmitResult.future(stalled(header_of(member, work), release),
                                               metadata=auth, timeout=60)
            assert silent.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "waited 3 s for its peer" in silent.details()
            assert stopped.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert "waited 11 s for its peer" in stopped.details()
        finally:
            release.set()


def test_a_large_message_is_given_the_time_the_slowest_link_needs():
    """A peer taking 1.5 s per message is slow, not idle, when a message is 4 MB (4 s at
    8 Mbit/s); with a one-byte message it is idle."""
    slots = CallSlots(CallLimits(idle_s=0.5))
    ended: list[Exception] = []

    def slow_peer(messages: Iterator[pb.FileChunk]) -> None:
        for _ in messages:
            time.sleep(1.5)

    with slots.stream("a", end=ended.append) as watch:
        slow_peer(watch.sent(iter([pb.FileChunk(data=bytes(4_000_000))] * 2)))
    assert ended == []
    with (slots.stream("a", end=ended.append) as watch,
          pytest.raises(StreamIdle, match=r"waited 0\.5 s for its peer")):
        slow_peer(watch.sent(iter([pb.FileChunk(data=b"x")] * 2)))
    assert len(ended) == 1


def test_members_with_work_have_a_stream_of_their_own_and_others_share_fairly():
    slots = CallSlots(CallLimits(streams=4), assigned=lambda client_id: client_id == "worker")
    with contextlib.ExitStack() as held:

        def stream(member: str) -> None:
            held.enter_context(slots.stream(member, end=lambda err: None))

        stream("x")
        stream("x")  # a second stream, while half the shared slots are free
        stream("y")
        with pytest.raises(NoStreamSlot, match="all that a second stream of a member may take"):
            stream("y")
        stream("z")  # the last shared slot
        with pytest.raises(NoStreamSlot, match="4 of the server's 4 shared stream slots"):
            stream("w")
        stream("worker")  # its own, though every shared slot is taken
        with pytest.raises(NoStreamSlot):
            stream("worker")  # a second stream is a shared one


def test_a_client_reaches_a_restarted_coordinator_within_seconds(tmp_path):
    """After an outage of 30 s, gRPC's own reconnect backoff (grown to 10-25 s by then,
    and to 120 s after longer ones) left a client's calls UNAVAILABLE long after the
    coordinator was back; the client's channel now tries again every 2 s at most."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from matformer.client.connection import Connection

    config = RunConfig.load(served_run_toml(tmp_path, min_clients=1))
    server = RunningServer.start(config, grpc_port=0, http_port=0)
    port = server.grpc_port
    health = health_pb2_grpc.HealthStub(Connection(f"127.0.0.1:{port}").channel)

    def answered() -> bool:
        try:
            health.Check(health_pb2.HealthCheckRequest(), timeout=2)
        except grpc.RpcError:
            return False
        return True

    assert answered()
    server.stop()
    down = time.monotonic()
    while time.monotonic() - down < 30:  # a client retrying through the outage
        assert not answered()
        time.sleep(1)
    server = RunningServer.start(config, grpc_port=port, http_port=0)
    try:
        back = time.monotonic()
        while not answered():
            time.sleep(0.2)
        waited = time.monotonic() - back
        assert waited < 4, waited  # at most the 2 s backoff, on a busy machine
    finally:
        server.stop()
