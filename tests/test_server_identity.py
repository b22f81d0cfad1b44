"""Identities that stick (issue 15, build 2): client keys, names unique per live member, a
member cap and a join-rate limit, and exclusions that bind to what a member can prove."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import stat
import subprocess
import sys

import grpc
import pytest
from support.helpers import Clock, run_config, served_run_toml
from support.rounds import caps
from support.wire import code_of, join_request

from matformer.protocol.auth import session_metadata
from matformer.protocol.channel import GRPC_OPTIONS
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.server.config import RunConfig
from matformer.server.coordinator import Coordinator
from matformer.server.errors import (
    BadCapabilities,
    Excluded,
    JoinsTooFast,
    NameTaken,
    PortUnavailable,
    RunFull,
    SessionInvalid,
)
from matformer.server.keys import KeyFile, KeyFileError
from matformer.server.main import RunningServer, main

# -- the keys file --------------------------------------------------------------------


def test_a_key_file_keeps_hashes_only_in_a_private_file(tmp_path):
    keys = KeyFile(tmp_path / "run" / "keys.json")
    alice = keys.add("alice")
    bob = keys.add("bob.laptop")  # a "." in the name: the secret after the last "." is read
    text = keys.path.read_text()
    assert alice not in text and alice.rpartition(".")[2] not in text
    assert stat.S_IMODE(keys.path.stat().st_mode) == 0o600
    assert keys.holder(alice).name == "alice" and keys.holder(bob).name == "bob.laptop"
    assert keys.holder(alice).key_hash == json.loads(text)["keys"]["alice"]["hash"]
    for forged in ("alice." + "A" * 43, bob.replace("bob.laptop", "alice"), "", "alice", "."):
        assert keys.holder(forged) is None, forged
    with pytest.raises(KeyFileError, match="already holds a key named 'alice'; `keys remove"):
        keys.add("alice")
    with pytest.raises(KeyFileError, match="is not 1-64 letters"):
        keys.add("x" * 65)
    keys.remove("alice")
    assert keys.holder(alice) is None and keys.holder(bob) is not None
    with pytest.raises(KeyFileError, match="holds no key named 'alice'"):
        keys.remove("alice")


@pytest.mark.parametrize("content", ["not json", "[]", '{"version": 1, "keys": {"a": 3}}',
                                     '{"version": 9, "keys": {}}', '{"keys": {}}'])
def test_a_damaged_key_file_is_a_named_error(tmp_path, content):
    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(KeyFileError, match=r"keys file .* cannot be read .*; restore it"):
        KeyFile(path).holder("a.b")


# -- the coordinator --------------------------------------------------------------------


def keyed(tmp_path, mdat_path, **round_overrides):
    """A coordinator in [auth] mode = "keys", its keys file holding alice and bob."""
    config = run_config(tmp_path / "run", mdat_path, **round_overrides)
    data = config.to_dict()
    data["auth"] = {"mode": "keys"}
    config = RunConfig.from_dict(data)
    keys = KeyFile(config.keys_path)
    issued = {name: keys.holder(keys.add(name)) for name in ("alice", "bob")}
    return Coordinator(config, clock=Clock()), issued


def test_a_key_names_its_member_and_a_second_join_with_it_replaces_the_first(
        tmp_path, mdat_path):
    c, key = keyed(tmp_path, mdat_path)
    first, _, token = c.join(caps("whatever-it-says"), key=key["alice"])
    assert first.name == "alice"
    assert c.current_round is not None and first.client_id in c.current_round.assignments
    # the same key from a restarted machine, at once (no waiting for the old one to lapse)
    second, _, _ = c.join(caps("alice"), key=key["alice"])
    assert second.client_id != first.client_id
    assert [m.name for m in c.membership.members.values()] == ["alice"]
    with pytest.raises(SessionInvalid):
        c.authenticate(token)
    assert first.client_id not in c.current_round.assignments  # its sequences went back


def test_an_exclusion_holds_the_key_and_locks_out_nobody_else(tmp_path, mdat_path):
    c, key = keyed(tmp_path, mdat_path)
    mallory, _, _ = c.join(caps("x"), key=key["bob"])
    c.exclude(mallory.client_id, "sent garbage")
    with pytest.raises(Excluded, match="the key of 'bob' was excluded from the run: sent garbage"):
        c.join(caps("bob"), key=key["bob"])
    with pytest.raises(Excluded):  # under any name it reports
        c.join(caps("carol"), key=key["bob"])
    # another key holder reporting the excluded name joins under its own key's name
    assert c.join(caps("bob"), key=key["alice"])[0].name == "alice"
    saved = json.loads((c.dir / "state.json").read_text())["membership"]["excluded_keys"]
    assert saved == {key["bob"].key_hash: "sent garbage"}
    again = Coordinator(c.config, clock=c.clock)  # the exclusion survives a restart
    with pytest.raises(Excluded):
        again.join(caps("bob"), key=key["bob"])


def test_a_live_members_name_is_its_own_until_it_falls_silent(tmp_path, mdat_path):
    clock = Clock()
    c = Coordinator(run_config(tmp_path / "run", mdat_path, min_clients=3), clock=clock)
    alice, _, token = c.join(caps("alice"))
    with pytest.raises(NameTaken, match="a live member of this run is named 'alice'"):
        c.join(caps("alice"))
    # a restarted alice proves its name with the session it saved
    back, _, new_token = c.join(caps("alice"), previous_session=token)
    assert back.client_id != alice.client_id
    with pytest.raises(SessionInvalid):
        c.authenticate(token)
    # an old session proves nothing once replaced
    with pytest.raises(NameTaken):
        c.join(caps("alice"), previous_session=token)
    # silent past heartbeat_timeout_s, the name is free for anyone
    clock.now += c.config.faults.heartbeat_timeout_s + 1
    taken, _, _ = c.join(caps("alice"))
    assert [m.client_id for m in c.membership.members.values()] == [taken.client_id]
    with pytest.raises(SessionInvalid):
        c.authenticate(new_token)


def test_a_join_the_tier_policy_refuses_leaves_the_member_it_would_replace(tmp_path, mdat_path):
    """Found by tests/test_fuzz_rpc.py: a join that proved alice's name with her session but
    reported no memory removed alice, then was refused."""
    c = Coordinator(run_config(tmp_path / "run", mdat_path, min_clients=3), clock=Clock())
    alice, _, token = c.join(caps("alice"))
    broken = dataclasses.replace(caps("alice"), memory_bytes=0)
    with pytest.raises(BadCapabilities, match="reports 0 bytes of memory"):
        c.join(broken, previous_session=token)
    assert list(c.membership.members) == [alice.client_id]
    assert c.authenticate(token) == alice.client_id


def test_joins_are_rate_limited_and_capped(tmp_path, mdat_path):
    config = run_config(tmp_path / "run", mdat_path, min_clients=100)
    config.faults.max_joins_per_minute = 10
    clock = Clock()
    c = Coordinator(config, clock=clock)
    for n in range(10):  # a burst of the full bucket
        c.join(caps(f"m{n}"))
    with pytest.raises(JoinsTooFast, match=r"more than 10 joins in a minute .* retry in 6 s"):
        c.join(caps("m10"))
    assert len(c.membership.members) == 10
    clock.now += 6.0  # one join's worth refilled
    c.join(caps("m10"))
    with pytest.raises(JoinsTooFast):
        c.join(caps("m11"))
    config.faults.max_members = 11
    clock.now += 60.0
    with pytest.raises(RunFull, match="the run has 11 members, the most it admits"):
        c.join(caps("m11"))
    # a join under a silent member's name takes its place, even in a full run
    c.leave("client-0")
    c.join(caps("m11"))
    c.membership.members["client-11"].last_seen = -1000.0
    assert c.join(caps("m11"))[0].client_id == "client-12" and len(c.membership.members) == 11
    # a refused join changes nothing: the member it would replace stays
    config.faults.max_members, config.faults.max_joins_per_minute = 20, 1
    clock.now += 60.0
    held, _, token = c.join(caps("m13"))
    with pytest.raises(JoinsTooFast):
        c.join(caps("m13"), previous_session=token)
    assert c.membership.named("m13") is held and c.authenticate(token) == held.client_id


# -- over gRPC, with the operator's command -----------------------------------------------


def keys_toml(tmp_path):
    return served_run_toml(tmp_path, min_clients=1, auth={"mode": "keys"})


def test_keys_mode_over_grpc_with_keys_issued_by_the_command(tmp_path):
    toml = keys_toml(tmp_path)
    issued = subprocess.run([sys.executable, "-m", "matformer.server.main", "keys", "add", "alice",
                             "--config", str(toml)], capture_output=True, text=True, check=True,
                            cwd=os.getcwd())
    key = issued.stdout.split()[0]
    assert key.startswith("alice.") and "keeps only its hash" in issued.stdout
    relay = subprocess.run([sys.executable, "-m", "matformer.server.main", "keys", "add", "lab",
                            "--relay", "--config", str(toml)], capture_output=True, text=True,
                           check=True)
    assert "--relay-token" in relay.stdout
    listed = subprocess.run([sys.executable, "-m", "matformer.server.main", "keys", "list",
                             "--config", str(toml)], capture_output=True, text=True, check=True)
    assert listed.stdout.startswith("alice\tmember\tissued ")
    assert "\nlab\trelay\tissued " in listed.stdout
    server = RunningServer.start(RunConfig.load(toml), grpc_port=0, http_port=0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", options=GRPC_OPTIONS)
    stub = pb_grpc.CoordinatorStub(channel)
    try:
        reply = stub.Join(join_request(server, token=key, name="mallory"))
        assert server.service.coordinator.membership.get(reply.client_id).name == "alice"
        code, details = code_of(lambda: stub.Join(join_request(server, token="alice.forged")))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "unknown client key" in details
        server.service.coordinator.exclude(reply.client_id, "sent garbage")
        code, details = code_of(lambda: stub.Join(join_request(server, token=key)))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "sent garbage" in details
        # keys added while the server runs count at once
        bob = KeyFile(server.service.coordinator.config.keys_path).add("bob")
        assert stub.Join(join_request(server, token=bob)).client_id
    finally:
        channel.close()
        server.stop()


def test_name_and_rate_refusals_carry_their_codes_over_grpc(tmp_path):
    config = RunConfig.load(served_run_toml(tmp_path, min_clients=5),
                         ["faults.max_joins_per_minute=2"])
    server = RunningServer.start(config, grpc_port=0, http_port=0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", options=GRPC_OPTIONS)
    stub = pb_grpc.CoordinatorStub(channel)
    try:
        alice = stub.Join(join_request(server, name="alice"))
        code, details = code_of(lambda: stub.Join(join_request(server, name="alice")))
        assert code == grpc.StatusCode.ALREADY_EXISTS and "choose another --name" in details
        # the session alice saved proves her name (sent as metadata on Join, as the client does)
        stub.Join(join_request(server, name="alice"),
                  metadata=session_metadata(alice.session_token))
        code, details = code_of(lambda: stub.Join(join_request(server, name="bob")))
        assert code == grpc.StatusCode.UNAVAILABLE and "max_joins_per_minute" in details
    finally:
        channel.close()
        server.stop()


def test_a_taken_port_is_a_named_error_not_a_traceback(tmp_path, capsys):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    toml = served_run_toml(tmp_path)
    try:
        with pytest.raises(PortUnavailable, match=f"gRPC port {port}.*choose \\[server\\]"):
            RunningServer.start(RunConfig.load(toml), grpc_port=port, http_port=0)
        free = socket.socket()
        free.bind(("127.0.0.1", 0))
        http_port = free.getsockname()[1]
        free.close()
        assert main(["--config", str(toml), "--set", f"server.grpc_port={port}",
                     "--set", f"server.http_port={http_port}"]) == 2
        err = capsys.readouterr().err
        assert "matformer-server: cannot listen on 127.0.0.1" in err and "Traceback" not in err
    finally:
        holder.close()
