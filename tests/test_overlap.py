"""Overlapped rounds ([round] overlap; docs/architecture.md, "One round"): round r is trained
on the weights after r - 1 rounds while round r - 1 closes, the next work rides on the answer
to a submission, and replicas stay bit-identical to the master."""

from __future__ import annotations

import dataclasses
import json
import threading
from concurrent.futures import Future

import pytest
import torch
from support.helpers import served_run_toml
from support.rounds import committed, flat_results
from support.wire import header_of, join_request, joined, serving_config
from test_federated import SEQ_LEN, client, held, same, start

import matformer.server.policies.mean as close_module  # the default policy calls close_round
from matformer.client.connection import Train
from matformer.client.errors import RoundOver
from matformer.client.rounds import OverlappedRounds, Reassigned
from matformer.modeling.batching import AdaptiveLimitsConfig, MicrobatchRunner, pack_rows
from matformer.modeling.checkpoint import load_pretrained
from matformer.modeling.mdat import build_default_mdat
from matformer.modeling.naming import canonical_state_dict
from matformer.modeling.training import TierSchedule, tier_gradients
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.submission import submission_messages
from matformer.server.config import RunConfig


@pytest.fixture(scope="module")
def mdat(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "docs.mdat"
    build_default_mdat(path, limit=60).close()
    return path


def trained_ids(run_dir) -> list[list[int]]:
    """The sequence ids of each closed round, from the run's ledger."""
    lines = (run_dir / "trained.jsonl").read_text().splitlines()
    return [entry["ids"] for entry in sorted(map(json.loads, lines), key=lambda e: e["round"])]


def test_one_client_dense_sgd_overlapped_equals_one_round_delayed_sgd(tmp_path, mdat):
    """One member, dense float32 results, outer sgd: with overlap the master after each round
    is, bit for bit, W[r+1] = W[r] - lr·g(W[r-1]) on round r's sequences (round 0 and 1 both
    on the start); the member's replica ends on the same weights."""
    lr, rounds = 0.05, 4
    server = start(tmp_path, mdat, encoding="dense", rule="sgd", lr=lr, rounds=rounds,
                   value_dtype="float32", overlap=True)
    try:
        federated = client(server, tmp_path, "solo", tier=0)
        summary = federated.run()
        assert summary.finished and summary.rounds_trained == rounds
        assert summary.resynchronisations == 0
        master = {n: t.clone() for n, t in server.service.coordinator.master.items()}
        reader = server.service.coordinator.reader
    finally:
        server.stop()

    model = load_pretrained(tmp_path / "run" / "checkpoints" / "round-0")
    runner = MicrobatchRunner(model, AdaptiveLimitsConfig(max_tokens=256).build())
    weights = [{n: p.detach().clone() for n, p in model.named_parameters()}]  # W[0], W[1], ...
    for r, ids in enumerate(trained_ids(tmp_path / "run")):
        base = weights[max(r - 1, 0)]
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(base[n])
        model.zero_grad(set_to_none=True)
        examples = [torch.from_numpy(reader[i].copy()).long() for i in ids]
        rows = pack_rows([len(e) for e in examples], SEQ_LEN)  # as the client packs them
        tier_gradients(runner, examples, TierSchedule(tiers=[0]), r, rows=rows)
        # torch.optim.SGD's own update, on the newest weights with the older gradient
        weights.append({n: weights[-1][n].add(p.grad, alpha=-lr)
                        for n, p in model.named_parameters()})
    assert len(weights) == rounds + 1
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(weights[-1][n])
    reference = canonical_state_dict(model)
    assert all(torch.equal(master[n], reference[n]) for n in reference)
    assert same(held(federated), reference)
    # not the synchronous run's weights: round 1 trained on the start, not on W[1]
    assert not all(torch.equal(weights[1][n], weights[0][n]) for n in weights[0])


def test_the_next_assignment_rides_on_the_answer_to_a_submission(tmp_path):
    """With overlap, three rounds are handed out at once, so the answer to a submission
    carries the member's next assignments and a member in steady state never asks GetRound;
    GetRound after a round answers the member's next one; sequences of any assignment it
    holds may be fetched ahead."""
    config = RunConfig.load(served_run_toml(tmp_path, min_clients=1))
    config = dataclasses.replace(config, round=dataclasses.replace(config.round, overlap=True))
    with serving_config(config) as (server, stub):
        member, auth, work = joined(stub, server, "alice")
        assert work.state == pb.ROUND_STATE_TRAIN and work.round == 0
        ahead = stub.GetRound(pb.GetRoundRequest(after_round=0), metadata=auth)
        assert (ahead.state, ahead.round) == (pb.ROUND_STATE_TRAIN, 1)
        fetched = list(stub.FetchSequences(pb.FetchSequencesRequest(
            ids=list(ahead.sequence_ids)), metadata=auth))
        assert [m.id for m in fetched] == list(ahead.sequence_ids)
        c = server.service.coordinator
        reply = stub.SubmitResult(submission_messages(header_of(member, work),
                                                      flat_results(c, member.client_id)),
                                  metadata=auth)
        assert [a.round for a in reply.assignments] == [1, 2]
        assert reply.assignments[0].assignment_id == ahead.assignment_id
        assert all(a.state == pb.ROUND_STATE_TRAIN for a in reply.assignments)


def test_summary_counts_the_calls_of_each_round(tmp_path, mdat):
    """summary.json says how many calls of each kind a member made, and per round trained
    (heartbeats aside): with overlap a round costs a SubmitResult, a FetchSequences and a
    GetUpdates, all beside the training."""
    rounds = 4
    server = start(tmp_path, mdat, encoding="dense", rule="sgd", lr=0.01, rounds=rounds,
                   overlap=True)
    try:
        summary = client(server, tmp_path, "solo", tier=0).run()
    finally:
        server.stop()
    assert summary.rounds_trained == rounds and summary.finished
    saved = json.loads((tmp_path / "clients" / "solo" / "summary.json").read_text())
    assert saved["rpcs"]["SubmitResult"] == rounds
    assert saved["rpcs"]["FetchSequences"] >= rounds
    per_round = sum(n for name, n in saved["rpcs"].items() if name != "Heartbeat") / rounds
    assert saved["rpcs_per_round"] == summary.rpcs_per_round == round(per_round, 2)


def test_members_calls_are_answered_while_a_round_closes(tmp_path, monkeypatch):
    """The close runs on the coordinator's close worker: while a deliberately slow close is
    under way, a member's SubmitResult has returned, and Heartbeat, GetRound (WAIT) and
    another member's Join are answered; the round commits once the close goes on."""
    entered, release = threading.Event(), threading.Event()
    real = close_module.close_round

    def slow(*args, **kwargs):
        entered.set()
        assert release.wait(60), "the test never released the close"
        return real(*args, **kwargs)

    monkeypatch.setattr(close_module, "close_round", slow)
    with serving_config(RunConfig.load(served_run_toml(tmp_path, min_clients=1))) as (
            server, stub):
        member, auth, work = joined(stub, server, "alice")
        c = server.service.coordinator
        try:
            stub.SubmitResult(submission_messages(header_of(member, work),
                                                  flat_results(c, member.client_id)),
                              metadata=auth, timeout=30)
            assert entered.wait(30)
            stub.Heartbeat(pb.HeartbeatRequest(round=0), metadata=auth, timeout=30)
            waiting = stub.GetRound(pb.GetRoundRequest(), metadata=auth, timeout=30)
            assert waiting.state == pb.ROUND_STATE_WAIT
            stub.Join(join_request(server, name="bob"), timeout=30)
            assert c.pipeline.closing is not None and c.state.round == 0  # still closing
        finally:
            release.set()
        committed(c, 1)
        assert stub.GetRound(pb.GetRoundRequest(), metadata=auth, timeout=30).round == 1


def test_a_member_moved_to_another_tier_keeps_its_replica_in_step(tmp_path, mdat):
    """The coordinator moves an overlapped member to a smaller tier while rounds at its old
    one are still in its hands, and the updates they need are asked for ahead: each update
    comes cut to the tier the replica holds (GetUpdatesRequest.tier), so every hash check
    holds, and the member reloads at its new tier when it meets an assignment at it. Before,
    they came cut to the new tier with its hash: the member reloaded, failed the check again
    and gave up (ReplicaDiverged), as the chaos test showed under load."""
    server = start(tmp_path, mdat, rounds=8, overlap=True, tiers=(0, 1))
    c = server.service.coordinator
    moved: list[int] = []

    def move(closed) -> None:  # (the coordinator's lock held) as [faults] misses would
        if closed.round == 1 and not moved:
            (member,) = c.membership.members.values()
            c.pipeline._retier(member, +1, "the test moves it")
            moved.append(member.tier)

    c.round_closed.append(move)
    try:
        summary = client(server, tmp_path, "mover").run()
    finally:
        server.stop()
    assert moved == [1]
    assert summary.finished and summary.rounds_trained >= 6
    assert summary.tier == 1 and summary.resynchronisations == 0


class _Stalled:
    """A member's side as its loop sees it after a coordinator restarted mid-round: round 3
    was reopened and its work handed out anew, so the update of round 3 never comes until
    this member trains it (each GetUpdates wait ends empty)."""

    def __init__(self) -> None:
        self.applied, self.tier, self.asks = 3, 0, 0
        self.cost = type("Cost", (), {"wait_s": 0.0})()
        self.log = lambda line: None
        self.broadcast = self
        self.connection = self

    def updates(self, since: int, tier: int, *, wait_s: float) -> list:
        self.asks += 1
        return []

    def get_round(self) -> Train:
        return Train(round=3, tier=0, sequence_ids=(7, 8), assignment_id="3.new.client-0")


def test_a_member_waiting_for_a_reopened_round_trains_it_instead_of_waiting_for_ever():
    """With overlap a member waits for round r - 2's update before training round r. When a
    restarted coordinator reopened that round and handed its work out anew, the round waits
    for this member: the member learns so after one empty wait and trains the new work
    (it once waited for ever: the testnet's chaos run with every member in that state)."""
    stalled = _Stalled()
    loop = OverlappedRounds(stalled)
    loop.taken.add("5.old.client-0")
    try:
        with pytest.raises(Reassigned) as raised:
            loop._apply_through(3)
        assert raised.value.work.assignment_id == "3.new.client-0" and stalled.asks == 1
        loop.taken.add("3.new.client-0")  # once it trains that work, it waits again
        stalled.asks = 0
        loop.asked = loop.downloads.submit(stalled.updates, 3, 0, wait_s=0.0)
        stalled.updates = lambda *a, **k: (_ for _ in ()).throw(AssertionError("stop"))
        with pytest.raises(AssertionError, match="stop"):
            loop._apply_through(3)  # no reassignment: it asks again
    finally:
        for pool in (loop.uploads, loop.fetches, loop.downloads):
            pool.shutdown()


class _Moved:
    """A member's side as its loop sees it when the coordinator moved it to another tier
    while its last upload was in flight, and that upload is refused (the run finished, or
    its round closed): the refusal drops the fetches made ahead."""

    def __init__(self) -> None:
        self.applied, self.tier, self.reloads, self.fetched_now = 5, 0, 0, []
        self.cost = type("Cost", (), {"wait_s": 0.0})()
        self.summary = type("Summary", (), {"tier": 0})()
        self.log = lambda line: self.lines.append(line)
        self.lines: list[str] = []
        self.sequences = self.broadcast = self.connection = self
        self.device, self.update_bytes, self.local_round = "cpu", 0, object()

    def updates(self, since: int, tier: int, *, wait_s: float) -> list:
        return []

    def catch_up(self, *, reload: bool = False) -> None:
        self.reloads += 1
        self.tier = self.summary.tier

    def fetch(self, ids):
        self.fetched_now.append(tuple(ids))
        raise RoundOver("FetchSequences", "FAILED_PRECONDITION", "the run is finished")


def test_a_refused_upload_during_a_tier_move_leaves_the_next_round_its_sequences():
    """The loop settles the upload in flight before reloading at the new tier; a refusal
    there drops the sequences fetched ahead, the next round's among them. It fetches them
    again (here: the run is over, and says so) instead of failing on the missing fetch
    (KeyError in the testnet's late-results runs, where uploads are refused at the end)."""
    member = _Moved()
    loop = OverlappedRounds(member)
    refused = Future()
    refused.set_exception(RoundOver("SubmitResult", "FAILED_PRECONDITION", "finished"))
    before = Train(round=4, tier=0, sequence_ids=(1,), assignment_id="4.x.client-0")
    work = Train(round=6, tier=1, sequence_ids=(7, 8), assignment_id="6.x.client-0")
    loop.upload = (before, None, 0.0, refused)
    loop.sequences[work.assignment_id] = loop.fetches.submit(lambda: [])
    try:
        loop._train(work, progress=None)
        assert member.reloads == 1 and member.fetched_now == [(7, 8)]
        assert any("round 6 is over for this client" in line for line in member.lines)
    finally:
        for pool in (loop.uploads, loop.fetches, loop.downloads):
            pool.shutdown()
