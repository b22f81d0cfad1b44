"""[server] heartbeat_port: heartbeats answered by a process of their own (server/heartbeats.py),
over real gRPC, the door a real child process of the coordinator."""

from __future__ import annotations

import dataclasses
import logging
import socket
import time

import grpc
import pytest
from support.helpers import JOIN_TOKEN, checked_tables, served_run_toml
from support.wire import code_of, join_request, serving_config

from matformer.client.connection import DOOR_RETRY_S, Connection
from matformer.protocol.auth import session_metadata
from matformer.protocol.channel import GRPC_OPTIONS, at_port
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.server.config import RunConfig
from matformer.server.errors import PortUnavailable
from matformer.server.heartbeats import SYNC_S, Beat, HeartbeatDoor
from matformer.server.main import RunningServer

WAIT_S = 20.0  # the coordinator's threads may wait long for the GIL on a loaded machine


def until(condition, what: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.02)


def door_config(folder, **server) -> RunConfig:
    config = RunConfig.load(served_run_toml(folder))
    return dataclasses.replace(config, server=dataclasses.replace(
        config.server, **{"heartbeat_port": 0, **server}))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with serving_config(door_config(tmp_path_factory.mktemp("door"))) as (server, stub):
        channel = grpc.insecure_channel(f"127.0.0.1:{server.door.port}", options=GRPC_OPTIONS)
        yield server, stub, pb_grpc.CoordinatorStub(channel)
        channel.close()


def test_a_beat_at_the_door_reaches_the_coordinator(served):
    server, stub, door = served
    reply = stub.Join(join_request(server, name="beater"))
    assert reply.heartbeat_port == server.door.port != server.grpc_port
    auth = session_metadata(reply.session_token)
    member = server.coordinator.membership.get(reply.client_id)
    joined_at = member.last_seen
    # at once after the Join: its token reached the door before the Join answered
    answer = door.Heartbeat(pb.HeartbeatRequest(tokens_per_second=4321.0), metadata=auth,
                            timeout=5)
    assert answer.round == server.coordinator.closed_rounds()
    until(lambda: member.tokens_per_second == 4321.0, "the beat's speed reported")
    assert member.last_seen >= joined_at


def test_the_door_refuses_what_the_coordinator_refuses(served):
    server, stub, door = served
    reply = stub.Join(join_request(server, name="refused"))
    auth = session_metadata(reply.session_token)
    code, details = code_of(lambda: door.Heartbeat(pb.HeartbeatRequest(), timeout=5))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "session token" in details
    wrong = session_metadata(f"{reply.client_id}.not-its-secret")
    assert code_of(lambda: door.Heartbeat(pb.HeartbeatRequest(), metadata=wrong,
                                          timeout=5))[0] == grpc.StatusCode.UNAUTHENTICATED
    code, details = code_of(lambda: door.Heartbeat(
        pb.HeartbeatRequest(tokens_per_second=float("nan")), metadata=auth, timeout=5))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "tokens_per_second" in details
    # the door answers beats and nothing else
    assert code_of(lambda: door.GetRound(pb.GetRoundRequest(), metadata=auth, timeout=5)
                   )[0] == grpc.StatusCode.UNIMPLEMENTED


def test_an_exclusion_and_a_leave_reach_the_door(served):
    server, stub, door = served
    excluded = stub.Join(join_request(server, name="excluded"))
    leaving = stub.Join(join_request(server, name="leaving"))
    server.coordinator.exclude(excluded.client_id, "tested")

    def denied() -> bool:
        try:
            door.Heartbeat(pb.HeartbeatRequest(),
                           metadata=session_metadata(excluded.session_token), timeout=5)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED and "tested" in err.details()
            return True
        return False

    until(denied, "the exclusion known at the door", timeout_s=WAIT_S + 10 * SYNC_S)
    # a Leave revokes the token before it answers, at the door too
    stub.Leave(pb.LeaveRequest(reason="done"),
               metadata=session_metadata(leaving.session_token), timeout=5)
    assert code_of(lambda: door.Heartbeat(
        pb.HeartbeatRequest(), metadata=session_metadata(leaving.session_token), timeout=5)
    )[0] == grpc.StatusCode.UNAUTHENTICATED


def test_beats_applied_late_keep_their_time_and_bad_ones_are_dropped(served, caplog):
    server, stub, _ = served
    coordinator = server.coordinator
    reply = stub.Join(join_request(server, name="late"))
    member = coordinator.membership.get(reply.client_id)
    seen = member.last_seen
    # dated two seconds ago (the door took it then): last_seen never goes back
    coordinator.apply_beats([Beat(reply.client_id, time.monotonic() - 2.0, 77.0, ())])
    assert member.last_seen == seen and member.tokens_per_second == 77.0
    coordinator.apply_beats([Beat(reply.client_id, time.monotonic(), None, ())])
    assert member.last_seen > seen
    with caplog.at_level(logging.WARNING, logger="matformer.server"):
        coordinator.apply_beats([
            Beat("client-424242", time.monotonic(), None, ()),  # no member: dropped quietly
            Beat(reply.client_id, time.monotonic(), 1e30, ()),  # no machine is that fast
            Beat(reply.client_id, time.monotonic(), None, (("m", 0, 1.0),)),  # not a relay
        ])
    assert member.tokens_per_second == 77.0 and member.relayed == []
    dropped = [r.getMessage() for r in caplog.records]
    assert len(dropped) == 2 and all(reply.client_id in line for line in dropped)


def test_a_member_beats_at_the_door_and_falls_back_when_it_is_gone(tmp_path):
    config = door_config(tmp_path)
    server = RunningServer.start(config, grpc_port=0, http_port=0)
    said: list[str] = []
    connection = Connection(f"127.0.0.1:{server.grpc_port}", patience_s=10, log=said.append)
    try:
        joined = connection.join(name="member", run_id="svc-test", join_token=JOIN_TOKEN,
                                 device_kind="cpu", device_name="cpu", memory_bytes=2**34,
                                 load_strategy="auto", microbatch_tokens=128, tier=0)
        member = server.coordinator.membership.get(joined.client_id)
        assert connection.beat_stub is not None
        connection.heartbeat(0, 1234.0)
        until(lambda: member.tokens_per_second == 1234.0, "the door's beat applied")
        server.door.stop()  # the door's port out of reach: beats go to the coordinator
        connection.heartbeat(0, 2345.0)
        assert member.tokens_per_second == 2345.0
        assert connection.door_again_at > time.monotonic() + DOOR_RETRY_S / 2
        assert sum("heartbeat port does not answer" in line for line in said) == 1
        # a door back on its port (a fixed heartbeat_port after a restart) is used again
        # once the retry time comes; until then the coordinator answers
        door = HeartbeatDoor.start(sessions=server.coordinator.membership.sessions,
                                   news=server.coordinator.beat_news,
                                   apply=server.coordinator.apply_beats, host="127.0.0.1",
                                   port=server.door.port)
        try:
            connection.door_again_at = time.monotonic() - 1
            connection.heartbeat(0, 3456.0)
            until(lambda: member.tokens_per_second == 3456.0, "the door's beat applied again")
            assert connection.door_again_at == 0.0  # answered there: no failure since
            assert sum("heartbeat port does not answer" in line for line in said) == 1
        finally:
            door.stop()
    finally:
        connection.close()
        server.stop()


def test_a_taken_heartbeat_port_is_said_plainly(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = door_config(tmp_path, heartbeat_port=taken.getsockname()[1])
        with pytest.raises(PortUnavailable, match="heartbeat_port"):
            RunningServer.start(config, grpc_port=0, http_port=0)


def test_the_heartbeat_port_is_its_own():
    with pytest.raises(ValueError, match="heartbeat_port is 7070"):
        RunConfig.from_dict(checked_tables(server={"heartbeat_port": 7070}))


def test_at_port_keeps_the_host():
    assert at_port("10.0.0.5:7070", 7072) == "10.0.0.5:7072"
    assert at_port("[::1]:7070", 9) == "[::1]:9"
    with pytest.raises(ValueError, match="host:port"):
        at_port("coordinator", 9)
