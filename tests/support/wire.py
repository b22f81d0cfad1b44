"""Calls to the run "svc-test" (helpers.served_run_toml) served on loopback, as the tests
make them over real gRPC and HTTP: a Join it accepts, a member's first calls, calls that
stall, the status a refused call ends with."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from matformer.modeling.checkpoint.schema import canonical_schema_hash
from matformer.protocol.auth import session_metadata
from matformer.protocol.channel import COORDINATOR_SERVICE, GRPC_OPTIONS
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.server.call_slots import CallLimits
from matformer.server.config import RunConfig
from matformer.server.main import RunningServer
from support.helpers import JOIN_TOKEN, served_run_toml

HONEST_TIMEOUT_S = 5.0  # what an honest call is given, client side


@contextlib.contextmanager
def serving(tmp_path, limits: CallLimits | None = None) -> Iterator[tuple[RunningServer, object]]:
    """A one-client run (the first member to join trains round 0 alone) and a stub."""
    config = RunConfig.load(served_run_toml(tmp_path, min_clients=1))
    if limits is not None:
        config = dataclasses.replace(config, faults=dataclasses.replace(
            config.faults, max_calls_per_member=limits.per_member,
            max_streams_per_member=limits.streams_per_member, max_streams=limits.streams,
            stream_idle_s=limits.idle_s, request_idle_s=limits.request_s,
            max_message_mb=limits.message_bytes / 2**20))
    with serving_config(config) as served:
        yield served


@contextlib.contextmanager
def serving_config(config: RunConfig) -> Iterator[tuple[RunningServer, pb_grpc.CoordinatorStub]]:
    """``config``'s run served on loopback, and a stub that calls it; stopped on exit."""
    server = RunningServer.start(config, grpc_port=0, http_port=0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", options=GRPC_OPTIONS)
    try:
        yield server, pb_grpc.CoordinatorStub(channel)
    finally:
        channel.close()
        server.stop()


def stalled(header: pb.SubmitHeader, release: threading.Event) -> Iterator[pb.SubmitMessage]:
    """A submission that sends its header, then nothing until ``release``."""
    yield pb.SubmitMessage(header=header)
    release.wait()


def stalled_unary(server, method: str, request_type, reply_type, release: threading.Event,
                  metadata=(), count: int = 20, timeout: float = 30) -> list[grpc.Future]:
    """``count`` calls of a one-request ``method`` that send their headers and never their
    request (a request stream that blocks until ``release``), on their own channel."""
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", options=GRPC_OPTIONS)
    call = channel.stream_unary(f"/{COORDINATOR_SERVICE}/{method}",
                                request_serializer=request_type.SerializeToString,
                                response_deserializer=reply_type.FromString)

    def nothing():
        release.wait()
        yield from ()

    return [call.future(nothing(), metadata=metadata, timeout=timeout) for _ in range(count)]


def schema_hash(server) -> str:
    c = server.service.coordinator
    return canonical_schema_hash(c.model_config, c.shapes)


def join_request(server, *, token=JOIN_TOKEN, schema=None, name="alice") -> pb.JoinRequest:
    return pb.JoinRequest(
        run_id="svc-test", join_token=token, client_name=name,
        capabilities=pb.Capabilities(device_kind="cpu", memory_bytes=2**34, requested_tier=0,
                                     tokens_per_second=1000.0, load_strategy="auto"),
        schema=pb.Schema(canonical_hash=schema_hash(server) if schema is None else schema))


def joined(stub, server, name: str) -> tuple[pb.JoinReply, tuple, pb.RoundAssignment]:
    reply = stub.Join(join_request(server, name=name), timeout=HONEST_TIMEOUT_S)
    auth = session_metadata(reply.session_token)
    return reply, auth, stub.GetRound(pb.GetRoundRequest(), metadata=auth)


def header_of(member: pb.JoinReply, work: pb.RoundAssignment, **changes) -> pb.SubmitHeader:
    fields = {"round": work.round, "client_id": member.client_id, "loss": 2.0,
              "assignment_id": work.assignment_id, **changes}
    return pb.SubmitHeader(**fields)


def code_of(call) -> tuple[grpc.StatusCode, str]:
    """The status a call ends with (streaming calls: the lambda drains the stream)."""
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


def http_get(server, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.http_port}{path}",
                                    timeout=5) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
