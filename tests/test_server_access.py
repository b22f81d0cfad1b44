"""Access control on real loopback servers: [auth] mode, the operator token on HTTP writes,
and TLS for gRPC and HTTPS (with a self-signed certificate from tests/certs.py)."""

from __future__ import annotations

import http.client
import ipaddress
import json
import logging
import socket
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from support.certs import self_signed
from support.helpers import JOIN_TOKEN, OPERATOR_TOKEN, checked_tables, served_run_toml
from support.wire import code_of, join_request

from matformer.protocol.auth import session_metadata
from matformer.protocol.channel import GRPC_OPTIONS
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.server.config import RunConfig
from matformer.server.errors import ConflictingKeys, InvalidValue, MissingKey, MissingSecret
from matformer.server.main import RunningServer, bind_host


def listening_addresses(port: int) -> set[str]:
    """The local addresses of the TCP sockets listening on ``port`` (Linux /proc/net)."""
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, port_hex = local.split(":")
            if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                ip = ipaddress.ip_address(socket.inet_ntop(family, words))
                found.add(str(getattr(ip, "ipv4_mapped", None) or ip))  # gRPC: ::ffff:127.0.0.1
    return found


def request(server, method: str, path: str, *, token: str | None = None, body=None,
            context: ssl.SSLContext | None = None) -> tuple[int, dict]:
    scheme = "http" if context is None else "https"
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{scheme}://127.0.0.1:{server.http_port}{path}", data=data,
                                 headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5, context=context) as reply:
            return reply.status, json.loads(reply.read() or b"null")
    except urllib.error.HTTPError as err:
        return err.code, {**json.loads(err.read() or b"{}"), "headers": err.headers}


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """A run with a join token, an operator token and TLS on both servers."""
    folder = tmp_path_factory.mktemp("secured")
    cert, _ = self_signed(folder)
    auth = {"join_token": JOIN_TOKEN, "operator_token": OPERATOR_TOKEN}
    path = served_run_toml(folder, auth=auth, tls={"cert": "cert.pem", "key": "key.pem"})
    server = RunningServer.start(RunConfig.load(path), grpc_port=0, http_port=0)
    assert server.wait_until_http_ready()
    credentials = grpc.ssl_channel_credentials(cert.read_bytes())
    channel = grpc.secure_channel(f"127.0.0.1:{server.grpc_port}", credentials,
                                  options=GRPC_OPTIONS)
    yield server, pb_grpc.CoordinatorStub(channel), ssl.create_default_context(cafile=cert)
    channel.close()
    server.stop()


# -- [auth] mode ------------------------------------------------------------------------


@pytest.mark.skipif(sys.platform != "linux", reason="reads the listening sockets in /proc/net")
def test_auth_none_joins_anyone_on_loopback_only(tmp_path, caplog):
    path = served_run_toml(tmp_path, auth="none", server={"host": "0.0.0.0"})
    config = RunConfig.load(path)
    assert config.auth.mode == "none" and config.server.host == "0.0.0.0"
    with caplog.at_level(logging.WARNING, logger="matformer.server"):
        server = RunningServer.start(config, grpc_port=0, http_port=0)
    try:
        assert server.wait_until_http_ready()
        assert server.host == "127.0.0.1"
        assert listening_addresses(server.grpc_port) == {"127.0.0.1"}
        assert listening_addresses(server.http_port) == {"127.0.0.1"}
        (warning,) = [r for r in caplog.records
                      if r.name == "matformer.server" and r.levelno == logging.WARNING]
        assert "127.0.0.1 only" in warning.getMessage()
        assert "host '0.0.0.0' is ignored" in warning.getMessage()
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            for token in ("anything", ""):
                reply = stub.Join(join_request(server, token=token, name=f"c{token}"), timeout=10)
                assert reply.session_token.startswith(reply.client_id)
        # No operator token configured: HTTP is read-only, and says how to change that.
        status, body = request(server, "POST", f"/api/clients/{reply.client_id}/exclude",
                               token="anything", body={"reason": "test"})
        assert status == 403 and "operator_token_env" in body["detail"]
        assert server.service.coordinator.membership.excluded == {}
    finally:
        server.stop()


@pytest.mark.parametrize(("host", "bound"), [("0.0.0.0", "127.0.0.1"), ("::", "127.0.0.1"),
                                             ("localhost", "127.0.0.1"), ("::1", "::1"),
                                             ("127.0.0.1", "127.0.0.1")])
def test_auth_none_bind_host(host, bound, caplog):
    config = RunConfig.from_dict(checked_tables(auth="none", server={"host": host}))
    with caplog.at_level(logging.WARNING, logger="matformer.server"):
        assert bind_host(config) == bound
    (warning,) = caplog.records
    assert (f"host {host!r} is ignored" in warning.getMessage()) == (host != bound)


@pytest.mark.parametrize(("host", "beyond_loopback"), [
    ("0.0.0.0", True), ("::", True), ("192.168.1.7", True), ("coordinator.example", True),
    ("localhost", False), ("::1", False), ("127.0.0.1", False), ("127.0.0.2", False)])
def test_a_host_beyond_loopback_without_tls_is_warned_about(host, beyond_loopback, tmp_path,
                                                            caplog):
    plaintext = RunConfig.from_dict(checked_tables(server={"host": host}))
    with caplog.at_level(logging.WARNING, logger="matformer.server"):
        assert bind_host(plaintext) == host
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == int(beyond_loopback)
    for warning in warnings:
        assert f"host {host!r} accepts other machines over plaintext" in warning
        assert "Set [tls] cert and key" in warning and "\n" not in warning
    caplog.clear()
    (tmp_path / "cert.pem").write_text("cert")
    (tmp_path / "key.pem").write_text("key")
    tls = RunConfig.from_dict(checked_tables(server={"host": host},
                                             tls={"cert": "cert.pem", "key": "key.pem"}),
                              base=tmp_path)
    with caplog.at_level(logging.WARNING, logger="matformer.server"):
        assert bind_host(tls) == host
    assert not caplog.records


# -- TLS ----------------------------------------------------------------------------------


def test_grpc_over_tls_needs_the_join_token_and_refuses_plaintext(secured):
    server, stub, _ = secured
    reply = stub.Join(join_request(server, name="tls"), timeout=10)
    assert reply.session_token.startswith(reply.client_id)
    assert code_of(lambda: stub.Join(join_request(server, token="wrong"), timeout=10))[0] == (
        grpc.StatusCode.UNAUTHENTICATED)
    with (grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as plain,
          pytest.raises(grpc.RpcError)):
        pb_grpc.CoordinatorStub(plain).Join(join_request(server), timeout=2)


def test_https_with_the_certificate_and_no_plain_http(secured):
    server, _, context = secured
    status, body = request(server, "GET", "/status", context=context)
    assert status == 200 and body["run_id"] == "svc-test"
    with pytest.raises((OSError, http.client.HTTPException)):  # URLError is an OSError
        request(server, "GET", "/status")
    with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
        request(server, "GET", "/status", context=ssl.create_default_context())


# -- the operator token -----------------------------------------------------------------


def test_exclude_needs_the_operator_token(secured):
    server, stub, context = secured
    c = server.service.coordinator
    mallory = stub.Join(join_request(server, name="mallory"), timeout=10)
    path = f"/api/clients/{mallory.client_id}/exclude"
    reason = {"reason": "sends garbage"}

    status, body = request(server, "POST", path, body=reason, context=context)
    assert status == 401 and "Authorization: Bearer" in body["detail"]
    assert body["headers"].get("WWW-Authenticate") == "Bearer"
    status, body = request(server, "POST", path, token="wrong", body=reason, context=context)
    assert status == 403 and "wrong operator token" in body["detail"]
    assert mallory.client_id not in c.membership.excluded

    status, body = request(server, "POST", path, token=OPERATOR_TOKEN, body=reason,
                           context=context)
    assert status == 200 and body == {"client_id": mallory.client_id,
                                      "excluded": "sends garbage"}
    assert c.membership.excluded[mallory.client_id] == "sends garbage"
    with pytest.raises(grpc.RpcError):
        stub.Heartbeat(pb.HeartbeatRequest(), metadata=session_metadata(mallory.session_token),
                       timeout=10)

    status, body = request(server, "POST", "/api/clients/nobody/exclude", token=OPERATOR_TOKEN,
                           body=reason, context=context)
    assert status == 404 and "nobody" in body["detail"]
    assert request(server, "POST", path, token=OPERATOR_TOKEN, body={},
                   context=context)[0] == 422


def test_a_body_that_is_not_text_is_refused_not_failed(secured):
    """Found by the fuzzer (tests/fuzz_rpc.py --target http): the operator's POST
    /api/clients/{id}/exclude with a body of bytes that are not UTF-8 (b"\\xfa\\xd5q^", sent
    as text/plain) was answered 500, and logged as an error: FastAPI's 422 could not show
    that input."""
    server, _, context = secured
    refused = urllib.request.Request(
        f"https://127.0.0.1:{server.http_port}/api/clients/nobody/exclude", data=b"\xfa\xd5q^",
        method="POST", headers={"Authorization": f"Bearer {OPERATOR_TOKEN}",
                                "Content-Type": "text/plain"})
    with pytest.raises(urllib.error.HTTPError) as answer:
        urllib.request.urlopen(refused, timeout=5, context=context)
    assert answer.value.code == 422
    assert json.loads(answer.value.read())["detail"][0]["input"] == "\ufffd\ufffdq^"


@pytest.mark.parametrize("method", ["PUT", "DELETE", "POST"])
def test_read_routes_refuse_writes(secured, method):
    server, _, context = secured
    assert request(server, method, "/status", context=context)[0] == 401
    assert request(server, method, "/status", token=OPERATOR_TOKEN, context=context)[0] == 405
    assert request(server, "GET", "/status", context=context)[0] == 200


# -- config -------------------------------------------------------------------------------


def test_auth_config_round_trips():
    for data in (checked_tables(auth="none"), checked_tables(auth={"mode": "none"}),
                 checked_tables(auth={"join_token": JOIN_TOKEN, "operator_token": OPERATOR_TOKEN})):
        config = RunConfig.from_dict(data)
        assert RunConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    none = RunConfig.from_dict(checked_tables(auth="none"))
    assert none.to_dict()["auth"] == {"mode": "none"} and none.auth.operator() is None
    with pytest.raises(InvalidValue, match=r'mode = "none" has no join token'):
        none.auth.token()
    secured = RunConfig.from_dict(checked_tables(auth={"join_token": JOIN_TOKEN,
                                                       "operator_token": OPERATOR_TOKEN}))
    assert secured.auth.operator() == OPERATOR_TOKEN and secured.auth.token() == JOIN_TOKEN
    assert OPERATOR_TOKEN not in repr(secured)


def test_operator_token_from_the_environment(monkeypatch):
    data = checked_tables(auth={"join_token": JOIN_TOKEN, "operator_token_env": "MATFORMER_OP"})
    with pytest.raises(MissingSecret, match=r"operator_token_env names \$MATFORMER_OP, which "):
        RunConfig.from_dict(data)
    monkeypatch.setenv("MATFORMER_OP", OPERATOR_TOKEN)
    assert RunConfig.from_dict(data).auth.operator() == OPERATOR_TOKEN


@pytest.mark.parametrize(("auth", "error", "pattern"), [
    ({"mode": "nnone"}, InvalidValue, r"\[auth\] mode 'nnone' is not one of token, keys, none; "
     r"did you mean 'none'\? choose one \(token: clients present the join token; keys: "),
    ("open", InvalidValue, r"\[auth\] mode 'open' is not one of token, keys, none"),
    ({"mode": "none", "join_token": "t"}, ConflictingKeys,
     r'mode = "none" admits clients without the join token, but join_token is given; '
     r'remove it'),
    ({"mode": "keys", "join_token": "t"}, ConflictingKeys,
     r'mode = "keys" admits clients without the join token, but join_token is given'),
    ({"join_token": "t", "keys_file": "k.json"}, ConflictingKeys,
     r'keys_file is given but mode = "token" does not read it'),
    ({"mode": "none", "join_token_env": "T"}, ConflictingKeys, r"but join_token_env is given"),
    ({"mode": "token"}, MissingKey, r'needs join_token_env .* \(mode = "none" runs without'),
    ({"join_token": "t", "operator_token": "o", "operator_token_env": "O"}, ConflictingKeys,
     r"both operator_token and operator_token_env; keep one"),
    ({"join_token": "t", "operator_token": ""}, InvalidValue, r"operator_token is empty"),
])
def test_auth_config_errors(auth, error, pattern):
    with pytest.raises(error, match=pattern):
        RunConfig.from_dict(checked_tables(auth=auth))
