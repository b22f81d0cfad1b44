"""Relays (relay/, docs/architecture.md "Relays"): a run whose members sit behind a relay
ends where the same members joined directly end, and what a relay loses goes back to the
root's queue. Real root coordinators and a real relay on loopback gRPC; members are stubs
that submit fixed DCT results, so both runs aggregate the very same results."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
from support.certs import self_signed
from support.helpers import JOIN_TOKEN, RELAY_TOKEN, Clock, checked_tables, served_run_toml
from support.models import tiny_config
from support.rounds import assigned
from support.wire import HONEST_TIMEOUT_S, code_of, header_of, join_request, serving_config

from matformer.client.mirror import MirrorFirst
from matformer.modeling.checkpoint.hf_config import to_config_dict
from matformer.modeling.compression import CompressionConfig, universal_config, universal_shapes
from matformer.modeling.errors import CodeOutsideCheckpoint, MatformerError
from matformer.protocol.auth import session_metadata
from matformer.protocol.channel import GRPC_OPTIONS, open_channel
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.protocol.submission import submission_messages
from matformer.relay.cache import FileCache, UpdateCache
from matformer.relay.main import Access, RelaySettings, RunningRelay, main, parser
from matformer.relay.relay import Relay, RelayError
from matformer.relay.rounds import RelayMember
from matformer.relay.upstream import RootWork
from matformer.server.api import clients_info
from matformer.server.call_slots import CallLimits
from matformer.server.config import RunConfig
from matformer.server.errors import (
    BadCapabilities,
    BadReport,
    RoleNotGranted,
    UpstreamError,
    WrongJoinToken,
)
from matformer.server.gate import MAX_RELAYED, check_relayed, check_tier_losses
from matformer.server.joins import credentials
from matformer.server.keys import KeyFile
from matformer.server.sections import FaultsSection
from matformer.server.tiers import MAX_TOKENS_PER_SECOND

ROUNDS = 3
WAIT_S = 120.0  # generous: a busy two-core machine runs these
COMPRESSION = {"encoding": "dct", "chunk": 16, "topk": 8}
MEMBERS = (("m0", 0), ("m1", 1))  # name, tier
SPEED = 1000.0  # tokens/s every member shows: the root and the relay split alike


def config(folder, *, min_clients: int, overlap: bool = False, **tables) -> RunConfig:
    """The run both sides train: sgd on DCT results, tiers 0 and 1, no peer clip (a partial
    is clipped as one result, where the members' own would each be), quick heartbeats."""
    tables = {"compression": COMPRESSION, "faults": {"peer_clip": 0.0, "heartbeat_s": 0.5},
              # the exact aggregate goes out: quantizing it (the default top-k of int8
              # levels) could move a level where float rounding crosses a step
              "update": {"rule": "sgd", "lr": 0.1, "schedule": "constant",
                         "broadcast_topk": 0}, **tables}
    return RunConfig.load(served_run_toml(folder, min_clients=min_clients,
                                          round={"min_clients": min_clients,
                                                 "deadline_s": 60.0, "tokens_per_round": 1024,
                                                 "rounds": ROUNDS, "overlap": overlap},
                                          **tables))


class Member:
    """A member that submits, each round, DCT results of a gradient fixed by its name and the
    round: the same results whichever coordinator it joined."""

    def __init__(self, address: str, server, name: str, tier: int, *, tls_ca=None,
                 token: str = JOIN_TOKEN, scale: float = 1.0) -> None:
        self.channel = open_channel(address, tls_ca=tls_ca, options=GRPC_OPTIONS)
        self.stub = pb_grpc.CoordinatorStub(self.channel)
        request = join_request(server, name=name, token=token)
        request.capabilities.requested_tier = tier
        self.reply = self.stub.Join(request, timeout=HONEST_TIMEOUT_S)
        self.auth = session_metadata(self.reply.session_token)
        self.name, self.tier = name, self.reply.tier
        self.scale = scale  # of its results' values: > 1, a loud member
        self.coordinator = server.service.coordinator  # the root: shapes and tier regions
        self.compressor = CompressionConfig(**COMPRESSION).build()
        self.rounds: list[pb.RoundAssignment] = []
        self.tokens: list[int] = []  # trained per round

    def results(self, work: pb.RoundAssignment, tokens: int):
        c = self.coordinator
        regions = c.regions(self.tier)
        for name in sorted(c.shapes):
            gen = torch.Generator().manual_seed(hash((self.name, name, work.round)) % 2**31)
            values = torch.randn(c.shapes[name], generator=gen) * self.scale
            yield self.compressor.encode(
                name, values[tuple(slice(a, b) for a, b in regions[name])],
                shape=c.shapes[name], region=regions[name], tokens=tokens)

    def work(self) -> pb.RoundAssignment | None:
        """The next assignment, waiting while there is none; None once the run finished."""
        give_up = time.monotonic() + WAIT_S
        while time.monotonic() < give_up:
            work = self.stub.GetRound(pb.GetRoundRequest(), metadata=self.auth,
                                      timeout=HONEST_TIMEOUT_S)
            if work.state == pb.ROUND_STATE_FINISHED:
                return None
            if work.state == pb.ROUND_STATE_TRAIN:
                return work
            time.sleep(0.05)
        raise AssertionError(f"{self.name} got no work within {WAIT_S:g} s")

    def submit(self, work: pb.RoundAssignment) -> pb.SubmitReply:
        """Fetch the work's sequences and submit its results: the answer."""
        ids = list(dict.fromkeys(work.sequence_ids))
        sequences = {s.id: s for s in self.stub.FetchSequences(
            pb.FetchSequencesRequest(ids=ids), metadata=self.auth, timeout=WAIT_S)}
        tokens = sum(sequences[i].tokens.shape[0] for i in work.sequence_ids)
        reply = self.stub.SubmitResult(submission_messages(
            header_of(self.reply, work, tokens=tokens, train_seconds=tokens / SPEED,
                      loss=1.0 + self.tier + work.round / 10),
            self.results(work, tokens)),
            metadata=self.auth, timeout=WAIT_S)
        self.rounds.append(work)
        self.tokens.append(tokens)
        return reply

    def train(self, work: pb.RoundAssignment) -> None:
        self.submit(work)
        # as a member does: wait for the round's update before asking for more work
        self.stub.GetUpdates(pb.GetUpdatesRequest(since_round=work.round, wait_seconds=WAIT_S,
                                                  tier=self.tier), metadata=self.auth,
                             timeout=WAIT_S).__iter__().__next__()

    def play(self, rounds: int) -> None:
        for _ in range(rounds):
            work = self.work()
            if work is None:
                return
            self.train(work)


def run_members(address: str, server, rounds: int = ROUNDS, scales=(1.0, 1.0),
                tiers=(0, 1), **access) -> list[Member]:
    members = [Member(address, server, f"m{i}", tier, scale=scale, **access)
               for i, (tier, scale) in enumerate(zip(tiers, scales, strict=True))]
    threads = [threading.Thread(target=m.play, args=(rounds,)) for m in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S * rounds)
    return members


def master(server, rounds: int = ROUNDS) -> dict[str, torch.Tensor]:
    """The root's master once ``rounds`` rounds are committed."""
    c = server.service.coordinator
    if rounds:
        c.wait_for_round(rounds - 1, WAIT_S)
    assert c.state.round == rounds, f"the run closed {c.state.round} of {rounds} rounds"
    return {name: tensor.clone() for name, tensor in c.master.items()}


ACCESS = Access(RELAY_TOKEN, JOIN_TOKEN)  # the run's relay token up, its join token down


def relay_for(server, tmp_path, **kwargs) -> RunningRelay:
    return RunningRelay.start(f"127.0.0.1:{server.grpc_port}", name="relay-a",
                              access=ACCESS, folder=tmp_path / "relay", **kwargs)


@pytest.mark.parametrize("tiers", [(0, 1), (0, 64)])
def test_members_behind_a_relay_end_where_the_same_members_joined_directly_end(tmp_path, tiers):
    """... also a member that asks for a Mix'n'Match slice (tier 64: layer 0 at tier 1, layer
    1 at tier 2): the relay sums its results over the slice's regions as the root would."""
    keys = {} if tiers == (0, 1) else {"tiers": {"allowed": [0, 1, 2], "layer_mixes": [[1, 2]]}}
    with serving_config(config(tmp_path / "direct", min_clients=2, **keys)) as (server, _):
        start = master(server, 0)
        direct_members = run_members(f"127.0.0.1:{server.grpc_port}", server, tiers=tiers)
        direct = master(server)
        direct_loss = dict(server.service.coordinator.state.loss)
    with serving_config(config(tmp_path / "relayed", min_clients=1, **keys)) as (server, _):
        relay = relay_for(server, tmp_path)
        root = server.service.coordinator
        listed, done = set(), threading.Event()

        def watch() -> None:  # what the root's page lists under the relay while it runs
            while not done.wait(0.05):
                for member in clients_info(root.snapshot(), operator=False).members:
                    listed.update((b.name, b.tier, b.tokens_per_second > 0)
                                  for b in member.behind)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            relayed_members = run_members(f"127.0.0.1:{relay.port}", server, tiers=tiers)
            relayed = master(server)
            done.set()
            watcher.join()
            # the root files each member's loss under its tier, through the relay as directly
            assert root.state.loss == direct_loss
            assert sorted(direct_loss) == sorted(map(str, tiers))
            (relay_member,) = root.membership.members.values()
            assert relay_member.relay and relay_member.name == "relay-a"
            # the root's page listed the members behind the relay, as its heartbeats report
            assert sorted(listed) == [("m0", tiers[0], True), ("m1", tiers[1], True)]
        finally:
            done.set()
            relay.stop("done")
    # the same split: each member trained as many tokens each round either way
    for a, b in zip(direct_members, relayed_members, strict=True):
        assert len(a.tokens) == ROUNDS and a.tokens == b.tokens
    assert [m.tier for m in direct_members] == [m.tier for m in relayed_members] == list(tiers)
    assert direct.keys() == relayed.keys() == start.keys()
    for name in direct:
        # summed in another order, with one more division: float32 rounding, no more
        torch.testing.assert_close(relayed[name], direct[name], rtol=1e-5, atol=1e-6)
    assert max(float((direct[n] - start[n]).abs().max()) for n in direct) > 1e-3


def test_a_relay_that_dies_is_a_member_that_dies_its_sequences_go_back(tmp_path):
    with serving_config(config(tmp_path, min_clients=1)) as (server, stub):
        root = server.service.coordinator
        relay = relay_for(server, tmp_path)
        member = Member(f"127.0.0.1:{relay.port}", server, "m0", 0)
        work = member.work()  # the relay holds round 0's work from the root
        held = root.assignment_for(relay.relay.root.client_id)
        assert sorted(held.sequence_ids) == sorted(work.sequence_ids)
        relay.stop("killed")  # it leaves the root before its members delivered
        # a member that joins the root directly now is handed those very sequences
        reply = stub.Join(join_request(server, name="direct"), timeout=HONEST_TIMEOUT_S)
        auth = session_metadata(reply.session_token)
        give_up = time.monotonic() + WAIT_S
        while (again := stub.GetRound(pb.GetRoundRequest(), metadata=auth)).state != \
                pb.ROUND_STATE_TRAIN:
            assert time.monotonic() < give_up
            time.sleep(0.05)
        assert sorted(again.sequence_ids) == sorted(held.sequence_ids)


def test_what_a_relays_member_does_not_deliver_goes_back_to_the_roots_queue(tmp_path):
    with serving_config(config(tmp_path, min_clients=1)) as (server, _):
        root = server.service.coordinator
        relay = relay_for(server, tmp_path)
        try:
            address = f"127.0.0.1:{relay.port}"
            first, second = (Member(address, server, n, t) for n, t in MEMBERS)
            work_first, work_second = first.work(), second.work()
            second.stub.Leave(pb.LeaveRequest(reason="gone"), metadata=second.auth)
            first.train(work_first)  # the relay hands in: the first's part, the second missed
            root.wait_for_round(0, WAIT_S)
            assert root.state.round == 1
            assert root.state.tokens == first.tokens[0]  # what was delivered, no more
            # the next round hands the missed sequences out again, first
            again = assigned(root, relay.relay.root.client_id)
            assert again.round == 1
            missed = list(work_second.sequence_ids)
            assert list(again.sequence_ids[:len(missed)]) == missed
        finally:
            relay.stop("done")


def test_the_root_refuses_a_relay_in_a_majority_vote_run(tmp_path):
    run = config(tmp_path, min_clients=1, update={"rule": "sign", "lr": 0.01, "vote": "majority"})
    with serving_config(run) as (server, stub):
        request = join_request(server, name="relay-a", token=RELAY_TOKEN)
        request.relay = True
        code, details = code_of(lambda: stub.Join(request, timeout=HONEST_TIMEOUT_S))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "vote" in details


def test_the_root_refuses_a_relay_when_its_round_policy_must_see_each_result(tmp_path):
    run = config(tmp_path, min_clients=1, policy={"name": "trimmed_mean"})
    with serving_config(run) as (server, stub):
        request = join_request(server, name="relay-a", token=RELAY_TOKEN)
        request.relay = True
        code, details = code_of(lambda: stub.Join(request, timeout=HONEST_TIMEOUT_S))
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert details.startswith("this run's round policy, trimmed_mean (trim 0.34), must "
                                  "see each member's result")


def test_only_a_relay_names_missed_sequences_or_losses_per_tier(tmp_path):
    with serving_config(config(tmp_path, min_clients=1)) as (server, stub):
        member = Member(f"127.0.0.1:{server.grpc_port}", server, "m0", 0)
        work = member.work()
        for relay_only in ({"missed_ids": [work.sequence_ids[0]]},
                           {"tier_losses": [pb.TierLoss(tier=0, tokens=1, loss=2.0)]}):
            header = header_of(member.reply, work, tokens=1, **relay_only)
            code, details = code_of(lambda h=header: stub.SubmitResult(
                submission_messages(h, []), metadata=member.auth, timeout=WAIT_S))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "only a relay" in details
        listing = pb.HeartbeatRequest(round=0, relayed=[pb.RelayedMember(name="x", tier=0)])
        code, details = code_of(lambda: stub.Heartbeat(listing, metadata=member.auth,
                                                       timeout=WAIT_S))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "only a relay lists members behind it" in details



def test_a_relay_with_topk_hands_the_root_k_coefficients_per_chunk(tmp_path):
    """Two relays in one round, the same two members' tiers behind each: the exact one sends
    the union of its members' positions, the one with --topk 2 two per chunk."""
    with serving_config(config(tmp_path, min_clients=2)) as (server, _):
        root = server.service.coordinator
        exact = relay_for(server, tmp_path / "exact")
        cut = RunningRelay.start(f"127.0.0.1:{server.grpc_port}", name="relay-b",
                                 access=ACCESS, folder=tmp_path / "cut", topk=2)
        try:
            members = [Member(f"127.0.0.1:{relay.port}", server, f"{relay.relay.root.name}-{n}",
                              tier) for relay in (exact, cut) for n, tier in MEMBERS]
            threads = [threading.Thread(target=m.play, args=(1,)) for m in members]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(WAIT_S)
            root.wait_for_round(0, WAIT_S)
            assert root.state.round == 1
            up = {m.name: m.bytes_up for m in root.membership.members.values()}
            assert up["relay-b"] < up["relay-a"] / 2, up
            assert cut.relay.recompress.carried  # what it left for the next round
        finally:
            cut.stop("done")
            exact.stop("done")


def test_a_relay_with_a_mirror_takes_the_broadcast_from_it(tmp_path):
    """--mirror at the root's own HTTP side (where a cache would sit): updates and checkpoint
    files come as blobs, checked by sha256, and the run goes on as without."""
    with serving_config(config(tmp_path, min_clients=1)) as (server, _):
        root = server.service.coordinator
        relay = relay_for(server, tmp_path, mirror=f"http://127.0.0.1:{server.http_port}")
        try:
            run_members(f"127.0.0.1:{relay.port}", server, rounds=2)
            root.wait_for_round(1, WAIT_S)
            source = relay.relay.updates.source
            assert source.fallbacks == 0 and source.mirror.update_bytes > 0
            blobs = server.http_server.config.app.state.blobs
            assert blobs.sent["update"] >= 1 and blobs.sent["file"] >= 1  # config.json
        finally:
            relay.stop("done")


def test_a_relay_joins_a_tls_root_with_its_own_key_and_serves_its_members_over_tls(tmp_path):
    cert, key = self_signed(tmp_path)
    run = config(tmp_path, min_clients=1, auth={"mode": "keys"},
                 tls={"cert": "cert.pem", "key": "key.pem"})
    relay_key = KeyFile(run.keys_path).add("relay-a", relay=True)  # the root grants the role
    with pytest.raises(RelayError, match="--member-token"):  # a key is never the members'
        Access(relay_key, tls_ca=cert)
    with serving_config(run) as (server, _):
        relay = RunningRelay.start(
            f"127.0.0.1:{server.grpc_port}", name="relay-a", folder=tmp_path / "relay",
            access=Access(relay_key, "lab-token", tls_ca=cert, tls_cert=cert, tls_key=key))
        try:
            address = f"127.0.0.1:{relay.port}"
            plaintext = code_of(lambda: Member(address, server, "m0", 0))
            assert plaintext[0] == grpc.StatusCode.UNAVAILABLE
            keyed = code_of(lambda: Member(address, server, "m0", 0, tls_ca=cert,
                                           token=relay_key))
            assert keyed[0] == grpc.StatusCode.UNAUTHENTICATED
            members = run_members(address, server, tls_ca=cert, token="lab-token")
            master(server)  # the root committed every round, over TLS, from the relay
            assert all(len(m.tokens) == ROUNDS for m in members)
            (relay_member,) = server.service.coordinator.membership.members.values()
            assert relay_member.relay and relay_member.name == "relay-a"
        finally:
            relay.stop("done")


def test_the_root_grants_the_relay_role_and_a_members_token_does_not_take_it(tmp_path):
    """A holder of the join token could once join as a relay and file losses for tiers no
    member trained; now a relay presents the run's relay token, which admits no member."""
    with serving_config(config(tmp_path, min_clients=1)) as (server, stub):
        as_relay = join_request(server, name="relay-x")
        as_relay.relay = True
        code, details = code_of(lambda: stub.Join(as_relay, timeout=HONEST_TIMEOUT_S))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert details.startswith("this credential admits a member, not a relay")
        assert "[auth] relay_token" in details
        code, details = code_of(lambda: stub.Join(join_request(
            server, name="m0", token=RELAY_TOKEN), timeout=HONEST_TIMEOUT_S))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert details.startswith("this credential admits a relay, not a member")
        with pytest.raises(UpstreamError) as refused:  # a real relay holding a member's token
            RunningRelay.start(f"127.0.0.1:{server.grpc_port}", name="relay-x",
                               access=Access(JOIN_TOKEN, "lab"), folder=tmp_path / "x")
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert not server.service.coordinator.membership.members
        relay = relay_for(server, tmp_path)  # the relay token admits it
        try:
            (member,) = server.service.coordinator.membership.members.values()
            assert member.relay and member.name == "relay-a"
        finally:
            relay.stop("done")


@pytest.mark.parametrize("mode", ["token", "token-without-relays", "keys"])
def test_only_the_operators_grant_admits_a_relay(tmp_path, mode):
    keys = tmp_path / "keys.json"
    auth = {"mode": "keys", "keys_file": str(keys)} if mode == "keys" else {
        "join_token": JOIN_TOKEN, **({"relay_token": RELAY_TOKEN} if mode == "token" else {})}
    run = RunConfig.from_dict(checked_tables(auth=auth), base=tmp_path)
    member, relay = JOIN_TOKEN, RELAY_TOKEN
    if mode == "keys":
        member, relay = KeyFile(keys).add("m0"), KeyFile(keys).add("r0", relay=True)
        assert credentials(run.auth, keys, relay, relay=True).relay
    elif mode == "token":
        assert credentials(run.auth, keys, relay, relay=True) is None
    assert credentials(run.auth, keys, member) is None or mode == "keys"
    with pytest.raises(RoleNotGranted, match="admits a member, not a relay"):
        credentials(run.auth, keys, member, relay=True)
    if mode != "token-without-relays":
        with pytest.raises(RoleNotGranted, match="admits a relay, not a member"):
            credentials(run.auth, keys, relay)
    else:  # no relay token: the would-be one is just a wrong token
        with pytest.raises(WrongJoinToken):
            credentials(run.auth, keys, relay, relay=True)


@pytest.mark.parametrize(("auth", "message"), [
    ({"join_token": "same", "relay_token": "same"}, "the relay token is the join token"),
    ({"mode": "keys", "relay_token": "r"}, "keys add NAME --relay"),
    ({"mode": "none", "relay_token_env": "R"}, "any relay on this machine may join"),
])
def test_a_relay_token_the_run_cannot_use_is_refused(tmp_path, auth, message):
    with pytest.raises(MatformerError, match=re.escape(message)):
        RunConfig.from_dict(checked_tables(auth=auth), base=tmp_path)


@pytest.mark.parametrize(("argv", "message"), [
    (["--relay-token", "relay-a." + "x" * 43], "no token for the relay's members"),
    (["--relay-token", "t", "--member-token", "t"], "the member token is the relay token"),
    (["--tls-cert", "cert.pem"], "--tls-cert is given but not --tls-key"),
    (["--tls-ca", "missing.pem"], "--tls-ca missing.pem does not exist"),
])
def test_the_relay_command_refuses_access_it_cannot_serve(tmp_path, monkeypatch, capsys, argv,
                                                          message):
    monkeypatch.chdir(tmp_path)
    for name in ("MATFORMER_MEMBER_TOKEN", "MATFORMER_JOIN_TOKEN", "MATFORMER_RELAY_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "cert.pem").write_text("not read: the key is missing first")
    assert main(["--upstream", "127.0.0.1:9", "--dir", str(tmp_path / "relay"), *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--min-members", "0"], "[relay] min_members must be >= 1, got 0."),
    (["--deadline-s", "-3"], "[relay] deadline_s must lie in (0, "),
    (["--port", "70000"], "[relay] port must lie in [0, 65535], got 70000."),
    ([], "--upstream HOST:PORT is required"),
])
def test_the_relay_commands_flags_are_checked_by_their_declarations(capsys, argv, message):
    upstream = [] if not argv else ["--upstream", "127.0.0.1:9"]
    with pytest.raises(SystemExit) as exited:
        main([*upstream, *argv])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_every_relay_setting_is_a_flag_of_the_command():
    shown = parser().format_help()
    for f in dataclasses.fields(RelaySettings):
        assert f"--{f.name.replace('_', '-')} " in shown, f.name


@pytest.mark.parametrize(("listed", "message"), [
    ([("a", 0, 9.0), ("a", 1, 9.0)], "'a' listed behind the relay (tier 1"),
    ([("a", 3, 9.0)], "(tier 3, 9.0 tokens/s) is not one the run can have"),
    ([("a", 0, float("nan"))], "nan tokens/s"),
    ([("", 0, 1.0)], "a name of 1 to 128 characters"),
    ([(f"m{i}", 0, 1.0) for i in range(MAX_RELAYED + 1)], "4097 members listed"),
])
def test_a_relays_list_of_members_is_refused_unless_the_run_could_have_them(listed, message):
    with pytest.raises(BadReport) as refused:
        check_relayed(listed, True, [0, 1])
    assert message in str(refused.value)
    assert check_relayed([("a", 1, 9.0)], True, [0, 1]) == [
        {"name": "a", "tier": 1, "tokens_per_second": 9.0}]


@pytest.mark.parametrize(("losses", "message"), [
    ([(0, 10, 2.0), (3, 6, 2.5)], "tier 3 at which the relay listed no member"),
    ([(0, 10, 2.0), (0, 6, 2.5)], "tier 0 twice"),
    ([(0, 10, 2.0), (1, 6, float("nan"))], "the reported loss nan"),
    ([(0, 10, 2.0)], "cover 10 tokens, but the members delivered 16"),
])
def test_a_relays_losses_per_tier_are_refused_unless_they_add_up(losses, message):
    with pytest.raises(BadReport, match=message):
        check_tier_losses(losses, [0, 1, 2], tokens=16)
    assert check_tier_losses([(1, 6, 2.5), (0, 10, 2.0)], [0, 1, 2], 16) == {
        0: (2.0, 10), 1: (2.5, 6)}


def test_under_overlap_a_relay_holds_the_roots_next_rounds_and_a_member_never_waits(tmp_path):
    """With [round] overlap the root hands out the next rounds before one closes; the relay
    holds them too, so each answer to a member's submission carries its next part."""
    with serving_config(config(tmp_path, min_clients=1, overlap=True)) as (server, _):
        relay = relay_for(server, tmp_path)
        try:
            member = Member(f"127.0.0.1:{relay.port}", server, "m0", 0)
            give_up = time.monotonic() + WAIT_S
            while len(relay.relay.held) < ROUNDS:  # the root's window: every round of the run
                assert time.monotonic() < give_up, f"the relay holds {len(relay.relay.held)}"
                time.sleep(0.05)
            work = member.work()
            for index in range(ROUNDS):
                assert work.round == index
                nexts = member.submit(work).assignments
                assert [a.round for a in nexts] == list(range(index + 1, ROUNDS))
                work = nexts[0] if nexts else None
            master(server)  # the root committed every round from the relay's hand-ins
            assert relay.relay.rounds_submitted == ROUNDS
        finally:
            relay.stop("done")


def test_a_relay_with_a_longer_deadline_than_the_roots_is_refused_in_one_line(tmp_path, capsys):
    with serving_config(config(tmp_path, min_clients=1)) as (server, _):
        root_s = server.service.coordinator.config.round.deadline_s  # 30
        with pytest.raises(RelayError) as refused:
            relay_for(server, tmp_path, deadline_s=root_s + 5)
        assert str(refused.value).startswith(
            f"--deadline-s {root_s + 5:g} is longer than the run's [round] deadline_s "
            f"{root_s:g}: the root would close rounds while this relay's members still train "
            f"them; give at most {root_s:g}, or leave it out (75% of the run's).")
        assert main(["--upstream", f"127.0.0.1:{server.grpc_port}",
                     "--relay-token", RELAY_TOKEN, "--member-token", JOIN_TOKEN,
                     "--deadline-s", "90", "--dir", str(tmp_path / "cmd")]) == 2
        said = capsys.readouterr().err.strip().splitlines()
        assert len(said) == 1 and said[0].startswith("matformer relay: error: --deadline-s 90 ")
        # the refused relays left: the root holds no member
        give_up = time.monotonic() + WAIT_S
        while server.service.coordinator.membership.members:
            assert time.monotonic() < give_up, "a refused relay stayed a member of the root"
            time.sleep(0.05)
        relay = relay_for(server, tmp_path)  # unset: 75% of the run's
        try:
            assert relay.relay.deadline_s == 0.75 * root_s
        finally:
            relay.stop("done")


def test_under_overlap_a_relays_deadlines_keep_within_the_roots(tmp_path):
    """A relay given the root's whole deadline still hands each held round in by the root's
    deadline for it (the wire says how long the root waits), and the round behind one it
    handed in early is pulled in as the root pulls its own in."""
    with serving_config(config(tmp_path, min_clients=1, overlap=True)) as (server, _):
        root = server.service.coordinator
        relay = relay_for(server, tmp_path, deadline_s=root.config.round.deadline_s)
        try:
            member = Member(f"127.0.0.1:{relay.port}", server, "m0", 0)
            give_up = time.monotonic() + WAIT_S
            while len(relay.relay.held) < ROUNDS:
                assert time.monotonic() < give_up, f"the relay holds {len(relay.relay.held)}"
                time.sleep(0.05)
            with relay.relay._changed:  # one look at both sides' clocks
                left = {h.work.round: h.deadline - relay.relay.clock() for h in relay.relay.held}
                root_left = {r.index: r.deadline - root.clock() for r in root.pipeline.collecting}
            for index, seconds in left.items():  # the relay's own rule would be later each round
                assert seconds <= root_left[index] + 0.5, (index, seconds, root_left)
            work = member.work()
            member.submit(work)  # round 0 in early: round 1 is due deadline_s from now at most
            give_up = time.monotonic() + WAIT_S
            while relay.relay.rounds_submitted < 1:
                assert time.monotonic() < give_up, "the relay never handed round 0 in"
                time.sleep(0.05)
            with relay.relay._changed:
                behind = relay.relay.held[0]
                assert behind.work.round == 1
                assert behind.deadline <= relay.relay.clock() + relay.relay.deadline_s
                assert all(p.assignment.deadline == behind.deadline
                           for p in behind.parts.values())
        finally:
            relay.stop("done")


class ScriptedRoot:
    """A root that hands out round 0 with ``deadline_in_seconds`` left, 4 tokens a sequence."""

    client_id = "relay-0"

    def __init__(self, deadline_in_seconds: float, ids: tuple[int, ...] = (1, 2)) -> None:
        self.deadline_in_seconds, self.ids = deadline_in_seconds, ids

    def get_round(self, after: int | None = None) -> RootWork:
        return RootWork(state="train", round=0, run_tokens=0, sequence_ids=self.ids,
                        assignment_id="0.x.relay-0", deadline_in_s=self.deadline_in_seconds)

    def fetch(self, ids) -> dict[int, torch.Tensor]:
        return {i: torch.arange(4) for i in ids}


@pytest.mark.parametrize(("root_left_s", "due_in_s"), [(100.0, 20.0), (12.0, 2.0), (0.0, 20.0)],
                         ids=["its own rule", "the root's deadline first", "an older root"])
def test_a_relay_hands_a_round_in_before_the_root_closes_it(tmp_path, root_left_s, due_in_s):
    """Members get the relay's deadline_s (20 of the root's 30), or less when the root's
    deadline for the round comes sooner: what the root leaves, less the 10 s the root's
    deadline gives over the relay's for handing in (0 on the wire: a root that does not say)."""
    clock = Clock(1000.0)
    relay = Relay(ScriptedRoot(root_left_s), member_token="t", deadline_s=20.0,
                  folder=tmp_path, clock=clock)
    relay.root_deadline_s = 30.0
    relay.members["m"] = RelayMember(client_id="m", name="m", tier=0, tokens_per_second=1.0,
                                     last_seen=clock.now)
    assert relay._take_round()
    (held,) = relay.held
    assert held.deadline == clock.now + due_in_s
    assert held.parts["m"].assignment.deadline == held.deadline


def test_a_claimed_speed_behind_a_relay_wins_no_more_than_a_typical_share(tmp_path):
    """The root's rule at the relay too: a member claiming 1e9 tokens/s beside two that
    showed 100 in a part they delivered gets a third of the round, not all of it, until a
    part of its own shows its speed."""
    clock = Clock(1000.0)
    relay = Relay(ScriptedRoot(100.0, ids=tuple(range(12))), member_token="t",
                  deadline_s=20.0, folder=tmp_path, clock=clock)
    relay.root_deadline_s = 30.0
    for name, speed, shown in (("a", 100.0, True), ("b", 100.0, True), ("fast", 1e9, False)):
        relay.members[name] = RelayMember(client_id=name, name=name, tier=0,
                                          tokens_per_second=speed, last_seen=clock.now,
                                          measured_by_round=shown)
    relay.seen("a", tokens_per_second=1e9)  # a heartbeat's claim: a shown speed stands
    assert relay.members["a"].tokens_per_second == 100.0
    assert relay._take_round()
    (held,) = relay.held
    assert {c: len(p.assignment.sequence_ids) for c, p in held.parts.items()} == {
        "a": 4, "b": 4, "fast": 4}


class LoggedRoot:
    """The root's GetUpdates over a log of closed rounds: one header message each."""

    def __init__(self, closed: int) -> None:
        self.closed = closed
        self.asked: list[tuple[int, float]] = []  # (since_round, wait_s) of each call

    def updates(self, since_round: int, tier: int, wait_s: float) -> list[pb.UpdateMessage]:
        self.asked.append((since_round, wait_s))
        return [pb.UpdateMessage(header=pb.RoundUpdateHeader(round=r))
                for r in range(since_round, self.closed)]


def test_the_relays_update_cache_answers_every_closed_round_not_only_those_it_holds():
    """A member that catches up once the run finished asks for every round since its
    replica's; the cache holding the first of them asks the root for the rest at once."""
    root = LoggedRoot(closed=5)
    cache = UpdateCache(root, MirrorFirst(None, print), closed=lambda: root.closed)
    assert [m.header.round for m in cache.messages(4, 0, wait_s=20.0)] == [4]
    root.closed = 6  # round 5 closed, and the relay heard so
    assert [m.header.round for m in cache.messages(4, 0, wait_s=0.0)] == [4, 5]
    # round 4 once, waiting as the member would; the rest from round 5, at once
    assert [since for since, _ in root.asked] == [4, 5] and root.asked[1][1] == 0.0
    assert [m.header.round for m in cache.messages(4, 0, wait_s=0.0)] == [4, 5]
    assert len(root.asked) == 2 and (cache.fetched, cache.served) == (2, 5)


def test_a_loud_member_behind_a_relay_is_clipped_to_its_peers_as_at_the_root(tmp_path):
    """[faults] peer_clip reaches the relay: it scales its members' results to their peers'
    before it folds them, so a loud member weighs what it would at the root. (Both at tier
    0: their results fold into one partial, which the root has no peers to clip against.)"""
    loud = {"faults": {"peer_clip": 2.0, "heartbeat_s": 0.5}}
    both = {"rounds": 2, "scales": (1.0, 1e3), "tiers": (0, 0)}
    with serving_config(config(tmp_path / "direct", min_clients=2, **loud)) as (server, _):
        start = master(server, 0)
        run_members(f"127.0.0.1:{server.grpc_port}", server, **both)
        direct = master(server, 2)
    with serving_config(config(tmp_path / "relayed", min_clients=1, **loud)) as (server, _):
        relay = relay_for(server, tmp_path)
        try:
            run_members(f"127.0.0.1:{relay.port}", server, **both)
            relayed = master(server, 2)
        finally:
            relay.stop("done")
    for name in direct:
        torch.testing.assert_close(relayed[name], direct[name], rtol=1e-5, atol=1e-6)
    moved = max(float((direct[n] - start[n]).abs().max()) for n in direct)
    assert 1e-3 < moved < 1.0  # the loud member counted, at its peers' magnitude


def test_a_member_behind_a_relay_is_held_to_the_runs_max_norm(tmp_path):
    bounded = {"faults": {"max_norm": 1e4, "norm_action": "reject", "peer_clip": 0.0,
                          "heartbeat_s": 0.5}}
    with serving_config(config(tmp_path, min_clients=1, **bounded)) as (server, _):
        relay = relay_for(server, tmp_path)
        try:
            member = Member(f"127.0.0.1:{relay.port}", server, "m0", 0, scale=1e6)
            work = member.work()
            code, details = code_of(lambda: member.submit(work))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_norm" in details, details
        finally:
            relay.stop("done")


def test_a_relay_takes_no_round_before_min_members_are_ready(tmp_path):
    """--min-members 2: the first member to join does not get the root's first rounds (under
    overlap, all three open ones) alone; the relay reports no speed until the second joins."""
    with serving_config(config(tmp_path, min_clients=1, overlap=True)) as (server, _):
        relay = relay_for(server, tmp_path, min_members=2)
        try:
            address = f"127.0.0.1:{relay.port}"
            first = Member(address, server, "m0", 0)
            time.sleep(1.0)  # a relay without the bound has taken the root's rounds by now
            assert relay.relay.held == [] and relay.relay.speed() == 0.0
            second = Member(address, server, "m1", 1)
            give_up = time.monotonic() + WAIT_S
            while not relay.relay.held:
                assert time.monotonic() < give_up
                time.sleep(0.05)
            members = {first.reply.client_id, second.reply.client_id}
            assert set(relay.relay.held[0].parts) == members
        finally:
            relay.stop("done")


class CheckpointFiles:
    """The relay's copy of the root's checkpoint files: what ``files.path`` hands back,
    written where the relay keeps them, and which it fetched."""

    def __init__(self, folder: Path, files: dict[str, str]) -> None:
        self.folder, self.files, self.fetched = folder, files, []

    def path(self, relative: str) -> Path:
        local = self.folder / relative
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_text(self.files[relative])
        self.fetched.append(relative)
        return local


@pytest.mark.parametrize("listed", ["evil.py", ".", "/tmp/evil.py", "../evil.py"])
def test_a_relay_runs_no_code_the_roots_checkpoint_names_unless_allowed(
        tmp_path, monkeypatch, listed):
    """The root's config.json naming module files: the relay's working folder is never
    searched, a name that leaves the checkpoint is refused, and one inside it runs only with
    --trust-remote-code, from the relay's own copy."""
    work = tmp_path / "work"
    work.mkdir()
    marker = tmp_path / "ran"
    code = f"import pathlib; pathlib.Path({str(marker)!r}).write_text('ran')\n"
    (work / "evil.py").write_text(code)  # what a module resolved against the cwd would run
    monkeypatch.chdir(work)
    data = to_config_dict(tiny_config()) | {"external_modules_path": [listed]}
    served = {"round-0/config.json": json.dumps(data), "round-0/evil.py": code}
    for trusted in (False, True):
        relay = Relay(ScriptedRoot(0.0), member_token="t", deadline_s=20.0,
                      folder=tmp_path / f"relay-{trusted}", trust_remote_code=trusted)
        relay.files = CheckpointFiles(relay.folder, served)
        if listed != "evil.py":
            with pytest.raises(CodeOutsideCheckpoint, match="do not load it"):
                relay._model_config("round-0", "config.json")
            continue
        config = relay._model_config("round-0", "config.json")
        if not trusted:  # registered components build it: the module is left out, not run
            assert config.external_modules_path is None and not marker.exists()
            continue
        assert config.external_modules_path == [str(relay.folder / "round-0" / "evil.py")]
        assert "round-0/evil.py" in relay.files.fetched
        universal_shapes(universal_config(config))  # builds the model's spec: imports it
        assert marker.read_text() == "ran"
    assert not (work / "__pycache__").exists()  # nothing was imported from the cwd


def test_a_relays_members_meet_the_roots_call_limits_and_join_rate(tmp_path):
    """One member cannot take a relay: its silent calls beyond the root's per-member share
    are refused while another member is still answered, and joins beyond
    [faults] max_joins_per_minute wait."""
    with serving_config(config(tmp_path, min_clients=1)) as (server, _):
        relay = relay_for(server, tmp_path)
        stop = threading.Event()
        channel = open_channel(f"127.0.0.1:{relay.port}")
        try:
            stub = pb_grpc.CoordinatorStub(channel)
            greedy, other = (stub.Join(join_request(server, name=name),
                                       timeout=HONEST_TIMEOUT_S) for name in ("greedy", "other"))

            def silent():
                stop.wait()
                yield from ()

            held = [stub.SubmitResult.future(silent(), metadata=session_metadata(
                greedy.session_token), timeout=30) for _ in range(CallLimits().per_member)]
            time.sleep(0.5)  # the calls reach the relay and take their slots
            with pytest.raises(grpc.RpcError) as refused:
                stub.Heartbeat(pb.HeartbeatRequest(), timeout=HONEST_TIMEOUT_S,
                               metadata=session_metadata(greedy.session_token))
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            stub.Heartbeat(pb.HeartbeatRequest(), timeout=HONEST_TIMEOUT_S,
                           metadata=session_metadata(other.session_token))
            stop.set()
            for call in held:
                with contextlib.suppress(grpc.RpcError):
                    call.result()
            joins = FaultsSection().max_joins_per_minute - 2  # two joined above
            for index in range(joins):
                stub.Join(join_request(server, name=f"m{index}"), timeout=HONEST_TIMEOUT_S)
            with pytest.raises(grpc.RpcError) as too_fast:
                stub.Join(join_request(server, name="one-more"), timeout=HONEST_TIMEOUT_S)
            assert too_fast.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "max_joins_per_minute" in too_fast.value.details()
        finally:
            stop.set()
            channel.close()
            relay.stop("done")


def test_members_of_one_name_behind_a_relay_keep_its_heartbeats_taken(tmp_path):
    """Found by the fuzzer (tests/fuzz_rpc.py --target relay): two members joined a relay
    under one name ("mutant"), the root refused each heartbeat of the relay's that listed
    them (a name twice), and the relay's speed and members never reached the root again."""
    with serving_config(config(tmp_path, min_clients=1)) as (server, _):
        lines: list[str] = []
        relay = relay_for(server, tmp_path, log=lines.append)
        try:
            for tier in (0, 1):
                Member(f"127.0.0.1:{relay.port}", server, "twin", tier)
            (listing,) = server.service.coordinator.membership.members.values()
            give_up = time.monotonic() + 10.0  # the root's heartbeat_s is 0.5 here
            while [m["name"] for m in listing.relayed] != ["twin"]:
                assert time.monotonic() < give_up, lines
                time.sleep(0.05)
            time.sleep(1.0)  # two heartbeats more
            assert not [line for line in lines if "heartbeat to the root failed" in line]
        finally:
            relay.stop("done")


def test_a_relay_takes_and_reports_only_speeds_the_root_takes(tmp_path):
    """Found by the fuzzer: a member's Heartbeat of 4.7e138 tokens/s was taken by the relay,
    and the root refused the relay's own heartbeats from then on (its members' speed
    together). The relay refuses that speed as the root does, and its members together
    count at most the fastest speed the root takes."""
    relay = Relay(ScriptedRoot(0.0), member_token="t", deadline_s=20.0, folder=tmp_path)
    for name in ("m0", "m1"):
        relay.members[name] = RelayMember(client_id=name, name=name, tier=0, last_seen=0.0,
                                          tokens_per_second=MAX_TOKENS_PER_SECOND)
    relay.clock = Clock(1.0)
    with pytest.raises(BadCapabilities, match="tokens/s"):
        relay.heartbeat("m0", tokens_per_second=4.6757255117284806e+138)
    assert relay.members["m0"].tokens_per_second == MAX_TOKENS_PER_SECOND
    assert relay.speed() == MAX_TOKENS_PER_SECOND


class RefusingRoot:
    """A root that serves no file."""

    def download(self, path: str, dest: Path) -> str:
        raise UpstreamError(grpc.StatusCode.NOT_FOUND, f"{path} is not served")


def test_a_file_the_root_refuses_leaves_nothing_in_the_relays_cache(tmp_path):
    """Found by the fuzzer: each path a member asked the relay for and the root refused left
    a lock behind in the relay's file cache (one per path, as many as members ask for), and
    one in a folder the cache has not (DownloadCheckpoint "round-9/matformer_manifest.json")
    left that folder in the relay's copy of the checkpoints."""
    cache = FileCache(RefusingRoot(), tmp_path / "checkpoints", MirrorFirst(None, print))
    for path in ("", "round-9/matformer_manifest.json", "a/b/c"):
        with pytest.raises(UpstreamError):
            cache.path(path)
    assert list(tmp_path.iterdir()) == []
    assert cache._locks == {} and cache.fetched == 0
