"""The status API under /api/ (server/api.py) on a real server: two real clients over gRPC
train two rounds at tiers 0 and 1 (one leaves in the second), and every endpoint answers
with the numbers of what happened, valid against the run's own OpenAPI schema."""

from __future__ import annotations

import dataclasses
import json
import math
import urllib.error
import urllib.request

import grpc
import pytest
import torch
from support.helpers import JOIN_TOKEN, OPERATOR_TOKEN, served_run_toml
from support.openapi import api_paths, response_errors
from support.rounds import assigned, committed
from support.wire import http_get, join_request

from matformer.protocol.auth import session_metadata
from matformer.protocol.channel import GRPC_OPTIONS
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.protocol.submission import submission_messages
from matformer.server.api import WITHHELD, hide_paths, rounds_info
from matformer.server.config import RunConfig
from matformer.server.held_out_log import HeldOutLog
from matformer.server.history import MAX_DEPARTED
from matformer.server.main import RunningServer
from matformer.server.membership import Member
from matformer.server.state import RunState

API = ("/api/run", "/api/clients", "/api/loss", "/api/held_out", "/api/rounds", "/api/events",
       "/api/dashboard")
OPERATED = {"join_token": JOIN_TOKEN, "operator_token": OPERATOR_TOKEN}  # [auth] with an operator


def compressed(coordinator, client_id, salt: float) -> list:
    """Results of one client at its tier, encoded with the run's own compression."""
    assignment = assigned(coordinator, client_id)
    regions = coordinator.regions(assignment.tier)
    compressor = coordinator.config.compression.build()
    generator = torch.Generator().manual_seed(int(salt * 1000))
    return [compressor.encode(name, torch.randn([b - a for a, b in regions[name]],
                                                generator=generator) * salt,
                              shape=coordinator.shapes[name], region=regions[name],
                              tokens=assignment.tokens)
            for name in sorted(coordinator.shapes)]


def submit(stub, coordinator, reply, *, loss: float) -> int:
    """Submit for the open round; the bytes the messages took on the wire."""
    assignment = assigned(coordinator, reply.client_id)
    header = pb.SubmitHeader(round=assignment.round, client_id=reply.client_id, loss=loss,
                             assignment_id=assignment.assignment_id)
    messages = list(submission_messages(header, compressed(coordinator, reply.client_id, loss)))
    stub.SubmitResult(iter(messages), metadata=session_metadata(reply.session_token))
    return sum(m.ByteSize() for m in messages)


def get(server, path: str):
    status, body = http_get(server, path)
    assert status == 200, (path, body[:300])
    return json.loads(body)


def get_as(server, path: str, token: str) -> tuple[int, dict]:
    """GET with ``Authorization: Bearer <token>``."""
    request = urllib.request.Request(f"http://127.0.0.1:{server.http_port}{path}",
                                      headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Round 0: alice (tier 0) and bob (tier 1) submit. Round 1: alice submits, bob leaves.
    Then carol joins and is excluded. The bytes each submission took, by round and name."""
    toml = served_run_toml(tmp_path_factory.mktemp("api"), auth=OPERATED,
                           compression={"encoding": "dct", "chunk": 8, "topk": 4})
    server = RunningServer.start(RunConfig.load(toml), grpc_port=0, http_port=0)
    assert server.wait_until_http_ready()
    c = server.service.coordinator
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", options=GRPC_OPTIONS)
    stub = pb_grpc.CoordinatorStub(channel)
    alice = stub.Join(join_request(server, name="alice"))
    request = join_request(server, name="bob")
    request.capabilities.requested_tier = 1
    request.capabilities.device_name = "Test Laptop CPU"
    request.capabilities.memory_bytes = 3 * 2**30
    bob = stub.Join(request)
    sent = {0: {"alice": submit(stub, c, alice, loss=3.0)}}
    sent[0]["bob"] = submit(stub, c, bob, loss=4.0)
    sent[1] = {"alice": submit(stub, c, alice, loss=2.5)}
    live = {path: get(server, path) for path in ("/api/run", "/api/clients")}  # round 1 open
    stub.Leave(pb.LeaveRequest(reason="done"), metadata=session_metadata(bob.session_token))
    committed(c, 2)  # bob's leave completed round 1; the close worker closes it
    carol = stub.Join(join_request(server, name="carol"))
    c.exclude(carol.client_id, "sent garbage")
    yield server, {"alice": alice, "bob": bob, "carol": carol}, sent, live
    channel.close()
    server.stop()


def test_every_response_matches_the_openapi_schema(run):
    server, *_, live = run
    openapi = get(server, "/openapi.json")
    assert set(API) <= api_paths(openapi)
    for path in API:
        assert response_errors(openapi, path, get(server, path)) == [], path
    assert response_errors(openapi, "/api/dashboard",
                           get(server, "/api/dashboard?since_round=1&events_after=2")) == []
    for path, body in live.items():  # taken while round 1 was open
        assert response_errors(openapi, path, body) == [], path


def test_the_open_round_while_it_is_open(run):
    _, replies, _, live = run
    opened = live["/api/run"]["open_round"]
    ids = {name: reply.client_id for name, reply in replies.items()}
    assert live["/api/run"]["phase"] == "collecting" and opened["round"] == 1
    assert opened["assigned"] == sorted([ids["alice"], ids["bob"]])
    assert opened["submitted"] == [ids["alice"]]
    states = {m["name"]: m["state"] for m in live["/api/clients"]["members"]}
    assert states == {"alice": "submitted", "bob": "training"}
    bob = next(m for m in live["/api/clients"]["members"] if m["name"] == "bob")
    assert (bob["tier"], bob["device_name"], bob["memory_bytes"]) == (
        1, "Test Laptop CPU", 3 * 2**30)
    assert bob["last_round"] == 0 and 0 < bob["last_round_share"] < 1


def test_the_schema_check_catches_a_wrong_response(run):
    server, *_ = run
    openapi = get(server, "/openapi.json")
    clients = get(server, "/api/clients")
    del clients["members"][0]["tier"]
    assert any("tier" in e for e in response_errors(openapi, "/api/clients", clients))
    rounds = get(server, "/api/rounds")
    rounds[0]["bytes_sent"] = "many"
    assert response_errors(openapi, "/api/rounds", rounds)
    assert response_errors(openapi, "/api/run", {**get(server, "/api/run"), "phase": "?"})
    events = get(server, "/api/events")
    events[0]["colour"] = "red"  # a field the schema does not list
    assert any("colour" in e for e in response_errors(openapi, "/api/events", events))


def test_run_and_clients(run):
    server, replies, *_ = run
    state = get(server, "/api/run")
    assert (state["run_id"], state["phase"], state["round"]) == ("svc-test", "collecting", 2)
    # carol's join opened round 2; her exclusion handed her share back, alice trains alone
    assert state["open_round"]["assigned"] == [replies["alice"].client_id]
    assert state["open_round"]["submitted"] == [] and state["rounds_planned"] == 5
    assert state["tokens"] == sum(r["tokens"] for r in get(server, "/api/rounds"))
    clients = get(server, "/api/clients")
    (alice,) = clients["members"]
    assert alice["client_id"] == replies["alice"].client_id and alice["tier"] == 0
    assert (alice["last_round"], alice["last_round_share"]) == (1, 1.0)
    assert alice["speed_measured"] and alice["tokens_per_second"] > 0
    assert alice["state"] == "training" and 0 <= alice["last_seen_s_ago"] < 30
    assert alice["tier_reason"] == replies["alice"].tier_reason
    assert clients["excluded"] == [{"client_id": replies["carol"].client_id, "name": "carol",
                                    "reason": WITHHELD}]  # "sent garbage": for the operator
    (bob,) = clients["departed"]
    assert (bob["client_id"], bob["name"], bob["tier"], bob["reason"]) == (
        replies["bob"].client_id, "bob", 1, "done")
    assert (bob["round"], bob["last_round"], bob["device_name"]) == (1, 0, "Test Laptop CPU")


def test_rounds_record_bytes_duration_slowest_and_drops(run):
    server, replies, sent, _ = run
    first, second = get(server, "/api/rounds")
    assert (first["round"], first["clients"], second["round"], second["clients"]) == (0, 2, 1, 1)
    assert first["bytes_sent"] == sum(sent[0].values())
    assert second["bytes_sent"] == sent[1]["alice"]
    c = server.service.coordinator
    dense = {t: 4 * sum(math.prod(b - a for a, b in region)
                        for region in c.regions(t).values()) for t in (0, 1)}
    assert first["bytes_dense"] == dense[0] + dense[1] and second["bytes_dense"] == dense[0]
    assert first["bytes_sent"] < first["bytes_dense"] / 4  # dct top-4 of 8×8 chunks
    assert first["slowest_name"] == "bob"  # bob submitted after alice
    assert first["slowest_client_id"] == replies["bob"].client_id
    assert 0 <= first["slowest_s"] <= first["duration_s"]
    assert 0 < first["close_s"] <= first["duration_s"] - first["slowest_s"]
    assert first["closed_at"] == pytest.approx(first["opened_at"] + first["duration_s"])
    assert first["dropped"] == []
    assert second["dropped"] == [{"client_id": replies["bob"].client_id, "name": "bob",
                                  "reason": "left the run"}]
    assert [r["round"] for r in get(server, "/api/rounds?since_round=1")] == [1]


def test_only_the_operator_reads_why_a_client_was_excluded(run):
    server, replies, *_ = run
    carol = replies["carol"].client_id
    public = get(server, "/api/dashboard")
    status, operator = get_as(server, "/api/dashboard", OPERATOR_TOKEN)
    assert status == 200 and response_errors(get(server, "/openapi.json"), "/api/dashboard",
                                             operator) == []
    for view, reason in ((public, WITHHELD), (operator, "sent garbage")):
        assert view["clients"]["excluded"] == [{"client_id": carol, "name": "carol",
                                                "reason": reason}]
        (excluded,) = [e for e in view["events"] if e["kind"] == "exclude"]
        assert (excluded["client_id"], excluded["detail"]) == (carol, reason)
    assert "sent garbage" not in json.dumps(public)
    assert get(server, "/api/clients")["excluded"] == public["clients"]["excluded"]
    assert get_as(server, "/api/clients", OPERATOR_TOKEN)[1]["excluded"] == (
        operator["clients"]["excluded"])
    assert get_as(server, "/api/events", OPERATOR_TOKEN)[1] == operator["events"]
    status, refused = get_as(server, "/api/clients", "not-the-token")
    assert status == 403 and "wrong operator token" in refused["detail"]


def test_a_round_record_withholds_an_exclusion_reason_but_no_other():
    record = {"round": 3, "opened_at": 0.0, "closed_at": 1.0, "duration_s": 1.0, "tokens": 8,
              "clients": 1, "slowest_client_id": "client-0", "slowest_name": "a",
              "slowest_s": 1.0, "bytes_sent": 1, "bytes_dense": 4,
              "dropped": [{"client_id": "client-1", "name": "b", "reason": "excluded: spam"},
                          {"client_id": "client-2", "name": "c", "reason": "silent for 31 s"}]}
    (public,) = rounds_info([record], operator=False)
    assert [d.reason for d in public.dropped] == [f"excluded: {WITHHELD}", "silent for 31 s"]
    (operator,) = rounds_info([record], operator=True)
    assert [d.reason for d in operator.dropped] == ["excluded: spam", "silent for 31 s"]


def test_no_answer_holds_a_path_of_this_machine(tmp_path):
    server = RunningServer.start(RunConfig.load(served_run_toml(tmp_path, auth=OPERATED)),
                                 grpc_port=0, http_port=0)
    try:
        assert server.wait_until_http_ready()
        c = server.service.coordinator
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}",
                                   options=GRPC_OPTIONS) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            alice, bob = (stub.Join(join_request(server, name=n)) for n in ("alice", "bob"))
        c.leave(alice.client_id, f"moved to {tmp_path}/elsewhere")
        c.exclude(bob.client_id, f"sent garbage, kept in {c.dir}/quarantine/bob.bin")
        c.history.event("disk", None, f"round 3 could not be saved ([Errno 28] No space left on "
                        f"device: '{c.dir / 'state.json'}')")  # as an OSError says it
        public = {p: http_get(server, p)[1].decode() for p in (*API, "/status", "/metrics")}
        operator = {p: json.dumps(get_as(server, p, OPERATOR_TOKEN)[1], ensure_ascii=False)
                    for p in API}
        assert not [p for p, answer in (*public.items(), *operator.items())
                    if str(tmp_path) in answer]
        assert "device: '…/state.json'" in get(server, "/api/events")[-1]["detail"]
        assert "moved to …/elsewhere" in public["/api/clients"]
        assert "kept in …/bob.bin" in operator["/api/clients"]
    finally:
        server.stop()


@pytest.mark.parametrize(("text", "shown"), [
    ("resumed at round 4 from /srv/runs/r1", "resumed at round 4 from …/r1"),
    ("No space left on device: '/srv/runs/r1/state.json'",
     "No space left on device: '…/state.json'"),
    ("(/a/b/), [/c/d]", "(…/b), […/d]"),
    ("1,000 tokens/s at tier 1/2; see http://host/x",
     "1,000 tokens/s at tier 1/2; see http://host/x"),
    ("already …/shown", "already …/shown"),
])
def test_hide_paths(text, shown):
    assert hide_paths(text) == shown


def test_loss_is_the_token_weighted_mean_per_tier(run):
    server, *_ = run
    loss = get(server, "/api/loss")
    assert loss == {"0": [{"round": 0, "loss": 3.0}, {"round": 1, "loss": 2.5}],
                    "1": [{"round": 0, "loss": 4.0}]}
    assert get(server, "/api/loss?since_round=1") == {"0": [{"round": 1, "loss": 2.5}],
                                                       "1": []}


def test_events_are_numbered_and_paged(run):
    server, replies, *_ = run
    events = get(server, "/api/events")
    assert [e["seq"] for e in events] == list(range(len(events)))
    kinds = [(e["kind"], e["client_id"]) for e in events]
    ids = {name: reply.client_id for name, reply in replies.items()}
    assert kinds == [("join", ids["alice"]), ("join", ids["bob"]), ("leave", ids["bob"]),
                     ("join", ids["carol"]), ("exclude", ids["carol"])]
    assert "bob (cpu) at tier 1" in events[1]["detail"]
    # each names the member as it names itself, as the client's own lines do (issue 32, 9)
    assert [e["name"] for e in events] == ["alice", "bob", "bob", "carol", "carol"]
    assert [e["seq"] for e in get(server, "/api/events?after=2")] == [3, 4]
    assert [e["seq"] for e in get(server, "/api/events?limit=2")] == [3, 4]
    assert http_get(server, "/api/events?after=-2")[0] == 422


def test_dashboard_is_one_snapshot_of_the_parts(run):
    server, *_ = run
    whole = get(server, "/api/dashboard")
    assert whole["loss"] == get(server, "/api/loss")
    assert whole["rounds"] == get(server, "/api/rounds")
    assert whole["events"] == get(server, "/api/events")
    assert whole["clients"]["excluded"] == get(server, "/api/clients")["excluded"]
    assert whole["run"]["round"] == get(server, "/api/run")["round"]
    assert whole["held_out"] == get(server, "/api/held_out") == {}  # nothing evaluated
    newer = get(server, "/api/dashboard?since_round=1&events_after=3")
    assert [r["round"] for r in newer["rounds"]] == [1]
    assert [e["seq"] for e in newer["events"]] == [4]


def test_status_and_the_page_come_from_the_same_numbers(run):
    server, *_ = run
    status = get(server, "/status")
    rounds = get(server, "/api/rounds")
    assert status["bytes_received"] == {str(r["round"]): r["bytes_sent"] for r in rounds}
    assert status["bytes_dense"] == {str(r["round"]): r["bytes_dense"] for r in rounds}
    code, page = http_get(server, "/")
    assert code == 200 and b"<html" in page.lower()


def test_round_records_and_numbered_events_are_saved_for_a_restart(run):
    server, *_ = run
    saved = RunState.load(server.service.coordinator.dir)
    assert saved.rounds == get(server, "/api/rounds")
    assert [e["seq"] for e in saved.events] == list(range(5))


def test_a_silent_member_shows_as_silent_and_a_joined_one_with_its_device(run):
    server, *_ = run
    c = server.service.coordinator
    (member,) = c.membership.members.values()
    seen = member.last_seen
    try:
        member.last_seen = seen - c.config.faults.heartbeat_timeout_s - 5
        (alice,) = get(server, "/api/clients")["members"]
        assert alice["state"] == "silent"
    finally:
        member.last_seen = seen


def test_device_name_and_memory_come_from_the_join(tmp_path):
    toml = served_run_toml(tmp_path, min_clients=3)
    server = RunningServer.start(RunConfig.load(toml), grpc_port=0, http_port=0)
    try:
        assert server.wait_until_http_ready()
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}",
                                   options=GRPC_OPTIONS) as channel:
            request = join_request(server, name="gpu-box")
            request.capabilities.device_kind = "cuda"
            request.capabilities.device_name = "NVIDIA H100 80GB HBM3"
            request.capabilities.memory_bytes = 80 * 2**30
            pb_grpc.CoordinatorStub(channel).Join(request)
        (row,) = get(server, "/api/clients")["members"]
        assert (row["device_kind"], row["device_name"], row["memory_bytes"]) == (
            "cuda", "NVIDIA H100 80GB HBM3", 80 * 2**30)
        assert row["last_round"] is None and row["state"] == "idle"
        assert get(server, "/api/run")["open_round"] is None
    finally:
        server.stop()



def test_events_saved_before_they_were_numbered_get_numbers_on_load(tmp_path):
    RunState(run_id="old", data_fingerprint="f", events=[
        {"time": 1.0, "round": 0, "kind": "join", "client_id": "client-0", "detail": "a"},
        {"time": 2.0, "round": 0, "kind": "leave", "client_id": "client-0", "detail": "b"},
    ]).save(tmp_path)
    loaded = RunState.load(tmp_path)
    assert [(e["seq"], e["detail"]) for e in loaded.events] == [(0, "a"), (1, "b")]
    assert loaded.rounds == [] and loaded.departed == []


def test_a_finished_run_that_everyone_left_says_who_took_part_and_its_last_loss(tmp_path):
    server = RunningServer.start(RunConfig.load(served_run_toml(
        tmp_path, min_clients=1, round={"min_clients": 1, "deadline_s": 30.0,
                                        "tokens_per_round": 1024, "rounds": 1})),
        grpc_port=0, http_port=0)
    try:
        assert server.wait_until_http_ready()
        c = server.service.coordinator
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}",
                                   options=GRPC_OPTIONS) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            alice = stub.Join(join_request(server, name="alice"))
            submit(stub, c, alice, loss=3.25)
            committed(c, 1)
            stub.Leave(pb.LeaveRequest(reason="finished"),
                       metadata=session_metadata(alice.session_token))
        run, clients = get(server, "/api/run"), get(server, "/api/clients")
        assert run["phase"] == "finished" and run["last_loss"] == {
            "0": {"round": 0, "loss": 3.25}}
        assert clients["members"] == [] and clients["took_part"] == 1
        assert [(d["name"], d["reason"], d["leaves"]) for d in clients["departed"]] == [
            ("alice", "finished", 1)]
    finally:
        server.stop()


def test_who_left_is_one_record_per_name_and_the_list_is_bounded(tmp_path):
    """A member that leaves and comes back again and again keeps one record that counts its
    leaves; beyond MAX_DEPARTED names the oldest are only counted, and the run still says
    how many took part, also after a restart."""
    toml = served_run_toml(tmp_path, min_clients=1000,  # no round opens: joins and leaves only
                           faults={"max_joins_per_minute": 10_000})
    server = RunningServer.start(RunConfig.load(toml), grpc_port=0, http_port=0)
    try:
        assert server.wait_until_http_ready()
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}",
                                   options=GRPC_OPTIONS) as channel:
            stub = pb_grpc.CoordinatorStub(channel)

            def visit(name: str, reason: str) -> None:
                reply = stub.Join(join_request(server, name=name), timeout=10)
                stub.Leave(pb.LeaveRequest(reason=reason), timeout=10,
                           metadata=session_metadata(reply.session_token))

            for n in range(3):
                visit("alice", f"visit {n}")
            clients = get(server, "/api/clients")
            assert [(d["name"], d["reason"], d["leaves"]) for d in clients["departed"]] == [
                ("alice", "visit 2", 3)]
            assert (clients["took_part"], clients["departed_beyond"]) == (1, 0)
            for n in range(MAX_DEPARTED + 5):
                visit(f"visitor-{n}", "bye")
            stub.Join(join_request(server, name="bob"), timeout=10)  # stays
        openapi = get(server, "/openapi.json")
        for path in ("/api/clients", "/api/dashboard"):
            body = get(server, path)
            assert response_errors(openapi, path, body) == []
            clients = body["clients"] if path == "/api/dashboard" else body
            assert [d["name"] for d in clients["departed"]] == [
                f"visitor-{n}" for n in range(5, MAX_DEPARTED + 5)]
            assert clients["departed_beyond"] == 6  # alice and the first five visitors
            assert clients["took_part"] == 1 + (MAX_DEPARTED + 5) + 1  # alice, visitors, bob
    finally:
        server.stop()
    saved = RunState.load(server.service.coordinator.dir)
    assert (len(saved.departed), saved.departed_beyond) == (MAX_DEPARTED, 6)


def test_departed_members_saved_before_leaves_were_counted_left_once(tmp_path):
    RunState(run_id="old", data_fingerprint="f", departed=[
        {"client_id": "client-0", "name": "a", "tier": 0, "device_kind": "cpu",
         "device_name": "", "tokens_per_second": 1.0, "last_round": None, "left_at": 1.0,
         "round": 0, "reason": "done"}]).save(tmp_path)
    (record,) = RunState.load(tmp_path).departed
    assert record["leaves"] == 1


def test_each_members_bytes_both_ways_against_dense(run):
    server, replies, sent, live = run
    c = server.service.coordinator
    alice = next(m for m in live["/api/clients"]["members"] if m["name"] == "alice")
    assert alice["bytes_up"] == sent[0]["alice"] + sent[1]["alice"]
    assert alice["dense_bytes_up"] == 2 * c.dense_bytes(0) == 2 * 4 * sum(
        math.prod(b - a for a, b in region) for region in c.regions(0).values())
    assert (alice["bytes_down"], alice["dense_bytes_down"]) == (0, 0)
    assert alice["compute_utilization"] == 0.0  # it reported no training seconds
    auth = session_metadata(replies["alice"].session_token)
    stub = pb_grpc.CoordinatorStub(grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}"))
    got = list(stub.GetUpdates(pb.GetUpdatesRequest(since_round=0), metadata=auth))
    rounds = sum(1 for m in got if m.WhichOneof("item") == "header")
    now = next(m for m in get(server, "/api/clients")["members"] if m["name"] == "alice")
    assert rounds == c.state.round == 2
    assert now["bytes_down"] == sum(m.ByteSize() for m in got)
    assert now["dense_bytes_down"] == rounds * c.dense_bytes(0)


def test_held_out_figures_are_served_as_evaluations_append_them(run):
    server, *_ = run
    log = HeldOutLog(server.service.coordinator.config.run.dir)
    path = log.path
    try:
        log.record(2, {1: 4.5, 0: 4.25}, sequences=32)
        served = get(server, "/api/held_out")
        assert served == {"0": [{"round": 2, "loss": 4.25, "sequences": 32}],
                          "1": [{"round": 2, "loss": 4.5, "sequences": 32}]}
        assert get(server, "/api/dashboard")["held_out"] == served
        openapi = get(server, "/openapi.json")
        assert response_errors(openapi, "/api/held_out", served) == []
    finally:
        path.unlink()  # the module's other tests see a run nobody evaluated


def test_a_members_record_is_its_fields_as_plain_data_with_its_lists_copied():
    """What the status API and state.json show of a member (read under the coordinator's
    lock, so a shallow copy, not ``asdict``'s deep one): the same data, unchanged by what
    the member's record takes after."""
    member = Member(client_id="client-0", name="m0", device_kind="cpu", tier=1,
                    tier_reason="asked", tokens_per_second=10.0, last_seen=2.0,
                    scores=[0.5], relay=True, relayed=[{"name": "a", "tier": 1}],
                    relayed_tiers=[1])
    record = member.record()
    assert record == dataclasses.asdict(member)
    member.scores.append(0.25)
    member.relayed_tiers.append(2)
    assert record["scores"] == [0.5] and record["relayed_tiers"] == [1]
    assert json.loads(json.dumps(record)) == record
