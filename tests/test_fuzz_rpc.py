"""tests/fuzz_rpc.py and tests/fuzz_http.py with small, seeded budgets: every RPC of the root
and of a relay in front of it survives random and mutated requests, a refused call leaves the
target as it was, and honest members complete a root round between the cases; the root's HTTP
side never fails, hangs or serves a file outside its folders, and a request it refuses
changes nothing. Each rule is shown to catch what it is for: an accepted input that breaks a
later round, a relay's handler that raises or a refusal that changes the relay, an HTTP
handler that fails, an HTTP refusal that writes to the run's folder, and a folder served
whole."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, NoReturn

import grpc
import pytest
from fuzz_http import fuzz_http
from fuzz_rpc import (
    HONEST,
    ROUND_EVERY,
    RPCS,
    RootTarget,
    fuzz,
    fuzz_relay,
    fuzz_server,
    join_request,
    snapshot,
    valid_submission,
)

from matformer.protocol.auth import session_metadata
from matformer.protocol.channel import COORDINATOR_SERVICE
from matformer.protocol.errors import UnsafePath
from matformer.protocol.files import resolve_inside
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.relay.relay import Relay
from matformer.server import http
from matformer.server.coordinator import Coordinator
from matformer.server.errors import FileNotServed, ServedFileDamaged, SessionInvalid
from matformer.server.membership import Member
from matformer.server.served_files import ServedFiles
from matformer.server.tiers import Capabilities, TierAssignment

EXAMPLES = 250
RELAY_EXAMPLES = 100
HTTP_EXAMPLES = 240
SHOWN = 12  # cases of a test that shows a rule catching what it is for
SECONDS = 120.0  # a cap, not a target: the cases end first, also on a busy machine


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    with fuzz_server(tmp_path_factory.mktemp("fuzz")) as server:
        yield fuzz(RootTarget(server), examples=EXAMPLES, seconds=SECONDS, seed=0)


def test_no_crash_and_no_change_on_refusal(fuzzed):
    report = fuzzed
    assert report.crashes == []
    assert report.state_changes == []
    assert report.tried == report.accepted + report.rejected >= 100
    assert report.accepted and report.rejected
    assert {rpc for rpc, _ in report.codes} == set(pb.DESCRIPTOR.services_by_name[
        "Coordinator"].methods_by_name)
    # issue 30: results with narrow ids or positions whose counts or shapes are off the run's
    assert report.hows["SubmitResult", "off layout"] >= 3
    # before the first case, after every ROUND_EVERY and after the last: each one round on
    assert report.rounds == 1 + math.ceil(report.tried / ROUND_EVERY)


def claims_inf(member: Member) -> None:
    member.tokens_per_second = math.inf  # as a Join once could: every later round failed to open


def shows_inf(member: Member) -> None:
    member.last_round_seconds = math.inf  # harmless to the rounds, but not to state.json


# The close worker cannot save state.json with the poisoned member in it: the close fails
# (and is retried in vain), and the fuzzer reports the failure as soon as it is logged
SAVE_FAILED = r"advancing the run failed.*Out of range float values are not JSON compliant"


@pytest.mark.parametrize("poison", [claims_inf, shows_inf])
def test_an_accepted_input_that_breaks_the_run_later_is_a_crash(tmp_path, monkeypatch, poison):
    """Issue 15: a Join with tokens_per_second = inf was accepted, and made the next round fail
    to open (every later call UNKNOWN, Infinity in state.json); the fuzzer then reported 0
    crashes, since it never reopened a round. Here every Join a case gets accepted (not the
    honest members') is poisoned that way: the next honest round must fail, the crash must
    name the accepted Join, and fuzzing must stop there."""
    join = Coordinator.join

    def poisoned(self: Coordinator, capabilities: Capabilities, **proof: Any
                 ) -> tuple[Member, TierAssignment, str]:
        member, tier, token = join(self, capabilities, **proof)
        if capabilities.name not in HONEST:
            poison(member)
        return member, tier, token

    monkeypatch.setattr(Coordinator, "join", poisoned)
    with fuzz_server(tmp_path) as server:
        # seed 0 gets a Join accepted by case 5; seeds 0 to 9 but 5 do within 135
        report = fuzz(RootTarget(server), examples=EXAMPLES, seconds=SECONDS, seed=0,
                      round_every=5)
    [crash] = [c for c in report.crashes if "stopped serving honest members" in c]
    assert re.search(SAVE_FAILED, crash), crash
    assert re.search(r"Join \(session: \w+\) → OK: .*, request \{run_id: ", crash), crash
    assert report.tried < EXAMPLES  # fuzzing stopped there: every later call would fail


def test_a_submission_cut_by_an_unparseable_message_keeps_nothing(tmp_path):
    """gRPC refuses a message it cannot parse and then ends the request stream as if it were
    complete; the results before it must not be kept."""
    with (fuzz_server(tmp_path) as server,
          grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}") as channel):
        stub = pb_grpc.CoordinatorStub(channel)
        joined = [stub.Join(join_request(server, name)) for name in ("alice", "bob")]
        submission = valid_submission(RootTarget(server), joined[0].client_id)
        blobs = [m.SerializeToString() for m in submission]
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


# -- a relay in front of the root -------------------------------------------------------------

@pytest.fixture(scope="module")
def relay(tmp_path_factory):
    with fuzz_relay(tmp_path_factory.mktemp("fuzz-relay")) as target:
        yield target


@pytest.fixture(scope="module")
def fuzzed_relay(relay):
    return fuzz(relay, examples=RELAY_EXAMPLES, seconds=SECONDS, seed=0)


def test_a_relay_survives_every_rpc_and_a_refusal_changes_nothing_of_it(relay, fuzzed_relay):
    """Issue 47: the relay serves its members the root's RPCs through the root's servicer;
    members joined through it complete a root round every ROUND_EVERY cases."""
    report = fuzzed_relay
    assert report.crashes == []
    assert report.state_changes == []
    assert report.tried == report.accepted + report.rejected == RELAY_EXAMPLES
    assert report.accepted and report.rejected
    assert {rpc for rpc, _ in report.codes} == set(RPCS)
    assert report.hows["SubmitResult", "off layout"] >= 2
    assert report.rounds == 1 + math.ceil(report.tried / ROUND_EVERY)
    # every round was the root's, its only member the relay
    root = relay.server.service.coordinator
    assert root.state.round >= report.rounds
    assert [m.name for m in root.membership.members.values()] == ["relay-fuzz"]


def test_an_exception_in_a_relays_handler_is_a_crash(relay, fuzzed_relay, monkeypatch):
    """The relay's member API raising (a bug, not a refusal) ends the call UNKNOWN. Here every
    session but an honest member's makes it raise: each such case is a crash, and the honest
    rounds go on."""
    authenticate = Relay.authenticate

    def broken(self: Relay, token: str) -> str:
        client_id = self.sessions.client_of(token)
        if client_id is None or self.members[client_id].name not in HONEST:
            raise RuntimeError("a bug in the relay")
        return authenticate(self, token)

    monkeypatch.setattr(Relay, "authenticate", broken)
    report = fuzz(relay, examples=SHOWN, seconds=SECONDS, seed=0)
    assert re.search(r"\(session: \w+\) → UNKNOWN: b'Exception calling application: a bug in",
                     " ".join(report.crashes)), report.crashes
    assert any("logged after" in crash for crash in report.crashes)
    assert report.tried == SHOWN and report.rounds >= 2  # the honest members were served


def test_a_refusal_that_changes_the_relay_is_found(relay, fuzzed_relay, monkeypatch):
    """A refused session counted as an admission (a counter a refusal must not move) is a
    state change of the relay's."""
    authenticate = Relay.authenticate

    def counting(self: Relay, token: str) -> str:
        if self.sessions.client_of(token) is None:
            self._next_id += 1
            raise SessionInvalid("unknown or revoked session token; call Join again.")
        return authenticate(self, token)

    monkeypatch.setattr(Relay, "authenticate", counting)
    report = fuzz(relay, examples=SHOWN, seconds=SECONDS, seed=0)
    assert report.crashes == []
    assert report.state_changes
    assert all(re.search(r"→ UNAUTHENTICATED: .* changed counts \(.*\"admitted\"", change)
               for change in report.state_changes), report.state_changes


# -- the root's HTTP side -----------------------------------------------------------------

@pytest.fixture(scope="module")
def http_server(tmp_path_factory):
    with fuzz_server(tmp_path_factory.mktemp("fuzz-http")) as server:
        yield server


@pytest.fixture(scope="module")
def fuzzed_http(http_server):
    return fuzz_http(http_server, examples=HTTP_EXAMPLES, seconds=SECONDS, seed=0)


def test_the_http_side_never_fails_hangs_or_leaks_and_a_refusal_changes_nothing(fuzzed_http):
    """Issue 47: every route of the root's HTTP side, climbs out of its folders and garbled
    requests; honest members complete a round after them."""
    report = fuzzed_http
    assert report.crashes == []
    assert report.state_changes == []
    served = report.hows["served", "route"]  # each served file and blob asked for once
    assert served and report.tried == report.accepted + report.rejected == HTTP_EXAMPLES + served
    assert {kind for _, kind in report.hows} == {"route", "traversal", "mutated"}
    assert report.codes["traversal", "404"] == report.hows["traversal", "traversal"]
    # served folders answered with their files (each checked to be one), and refusals met
    # the snapshot
    assert report.codes["/files/{path}", "200"] + report.codes[
        "/blobs/sha256/{digest}", "200"] >= served
    assert {code for _, code in report.codes} >= {"200", "400", "401", "404", "422"}
    assert report.rounds == 3  # two before the cases, one after


def failing(self: ServedFiles, relative: str) -> NoReturn:
    raise RuntimeError("a bug in the HTTP side")


def damaged(self: ServedFiles, relative: str) -> NoReturn:
    raise ServedFileDamaged(f"the server's copy of {relative} is damaged")


@pytest.mark.parametrize(("verified", "seen"), [
    (failing, r"→ 500: b'Internal Server Error'.*logged after .*Exception in ASGI application"),
    (damaged, r"→ 500: .*the server.*s copy of \S+ is damaged")],
    ids=["raises", "answers 500"])
def test_an_http_answer_500_is_a_crash(http_server, fuzzed_http, monkeypatch, verified, seen):
    """A handler that raises (Starlette answers 500 and uvicorn logs it) and one that answers
    500 on purpose (a checkpoint file damaged) are both crashes."""
    monkeypatch.setattr(ServedFiles, "verified", verified)
    report = fuzz_http(http_server, examples=SHOWN, seconds=SECONDS, seed=0)
    assert re.search(seen, " ".join(report.crashes)), report.crashes


def test_a_file_served_from_outside_the_checkpoints_is_a_leak(http_server, fuzzed_http,
                                                              monkeypatch):
    """A /files/ route that serves any path it is given (no manifest, no folder) hands out the
    canaries planted beside the checkpoints: the fuzzer reports it."""
    def anything(self: ServedFiles, relative: str) -> tuple[Path, None]:
        path = self.root / relative
        if not path.is_file():
            raise FileNotServed(f"{relative} is not a file")
        return path, None

    monkeypatch.setattr(ServedFiles, "verified", anything)
    report = fuzz_http(http_server, examples=SHOWN, seconds=SECONDS, seed=0)
    assert any(crash.startswith("served b'canary: a file") for crash in report.crashes), \
        report.crashes


def test_a_refusal_that_changes_the_run_is_found(http_server, fuzzed_http, monkeypatch):
    """An operator refusal (401, 403) that leaves a note in the run's folder, a change no
    refused request may make, is reported."""
    refusal_of = http.operator_refusal
    notes = http_server.service.coordinator.dir / "refusals.log"

    def noting(authorization: str | None, token: str | None) -> tuple[int, str] | None:
        refusal = refusal_of(authorization, token)
        if refusal is not None:
            with notes.open("a") as log:
                log.write(f"{refusal[0]}\n")
        return refusal

    monkeypatch.setattr(http, "operator_refusal", noting)
    report = fuzz_http(http_server, examples=3 * SHOWN, seconds=SECONDS, seed=0)
    assert report.crashes == []
    assert report.state_changes
    assert all(re.search(r"→ 40[13]: .* changed files \(", change)
               for change in report.state_changes), report.state_changes
