"""The coordinator core in-process: membership, work queue, rounds, rejections, persistence."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path

import grpc
import pytest
import torch
from support.helpers import Clock, run_config
from support.rounds import caps, drive, gradient, results, same

from matformer.modeling.checkpoint.export import read_manifest
from matformer.modeling.checkpoint.files import read_weights
from matformer.server.coordinator import Coordinator
from matformer.server.errors import (
    BadResult,
    DuplicateResult,
    MalformedResult,
    StaleRound,
    UnknownParameter,
    UpdatesPruned,
    WrongRegion,
)

UP = "model.layers.0.mlp.up_proj.weight"  # (intermediate, hidden): tiers narrow its rows


def snapshot(coordinator):
    return {n: t.clone() for n, t in coordinator.master.items()}


def test_assignment_is_proportional_to_tokens_per_second(tmp_path, mdat_path):
    c = Coordinator(run_config(tmp_path / "run", mdat_path, min_clients=2), clock=Clock())
    fast, _, token = c.join(caps("fast", tps=3000.0))
    assert c.phase == "waiting" and c.membership.sessions.client_of(token) == fast.client_id
    slow, _, _ = c.join(caps("slow", tps=1000.0))
    assert c.phase == "collecting"
    a, b = c.assignment_for(fast.client_id), c.assignment_for(slow.client_id)
    ids = a.sequence_ids + b.sequence_ids
    assert list(ids) == c.queue.order.training[:len(ids)].tolist()  # the shuffled queue head
    # claimed speeds count up to the lower median of the members' (1000) until a round
    # measures them: an even split
    assert abs(len(a.sequence_ids) - len(b.sequence_ids)) <= 1
    assert a.tokens + b.tokens <= 1024 and a.round == 0


def test_a_members_longest_silence_is_the_longest_time_between_two_of_its_calls(
        tmp_path, mdat_path):
    clock = Clock(100.0)
    c = Coordinator(run_config(tmp_path / "run", mdat_path, min_clients=2), clock=clock)
    a, _, _ = c.join(caps("a"))
    for now in (102.0, 109.5, 111.0):
        clock.now = now
        c.heartbeat(a.client_id)
    (member,) = c.snapshot(events_after=None)["members"]
    assert member["longest_silence_s"] == 7.5


def test_speed_comes_from_reports_then_from_the_clients_compute_time(tmp_path, mdat_path):
    clock = Clock()
    c = Coordinator(run_config(tmp_path / "run", mdat_path, min_clients=2), clock=clock)
    a, _, _ = c.join(caps("a", tps=0.0))
    c.heartbeat(a.client_id, tokens_per_second=500.0)  # measured after loading the model
    assert c.membership.get(a.client_id).tokens_per_second == 500.0
    c.join(caps("b"))  # the second member opens round 0
    work = c.assignment_for(a.client_id)
    clock.now = 9.0  # it waited and downloaded, but trained for 2 s
    c.submit(a.client_id, 0, results(c, a.client_id), train_seconds=2.0)
    assert c.membership.get(a.client_id).tokens_per_second == work.tokens / 2.0
    c.heartbeat(a.client_id, tokens_per_second=1.0)  # a round's measurement wins
    assert c.membership.get(a.client_id).tokens_per_second == work.tokens / 2.0


def test_missed_deadline_requeues_ids_and_measures_speed(tmp_path, mdat_path):
    clock = Clock()
    c = Coordinator(run_config(tmp_path / "run", mdat_path, min_clients=2), clock=clock)
    a, _, _ = c.join(caps("a"))
    b, _, _ = c.join(caps("b"))
    missed, done = c.assignment_for(b.client_id), c.assignment_for(a.client_id)
    clock.now = 4.0
    c.submit(a.client_id, 0, results(c, a.client_id))
    assert c.membership.get(a.client_id).tokens_per_second == done.tokens / 4.0
    clock.now = 10.0
    with pytest.raises(StaleRound):  # the deadline closes round 0 before b's results count
        c.submit(b.client_id, 0, results(c, b.client_id))
    assert c.state.round == 1 and c.current_round.index == 1
    nxt = c.current_round.assignments
    handed = [i for cid in nxt for i in nxt[cid].sequence_ids]
    assert handed[:len(missed.sequence_ids)] == list(missed.sequence_ids)
    assert c.state.tokens == done.tokens == c.log.read(0).coverage_tokens[UP]  # a's only


def test_leave_requeues_and_round_closes_with_the_rest(tmp_path, mdat_path):
    c = Coordinator(run_config(tmp_path / "run", mdat_path, min_clients=1), clock=Clock())
    a, _, _ = c.join(caps("a"))
    b, _, _ = c.join(caps("b"))  # joins while round 0 is open: waits for round 1
    assert c.assignment_for(b.client_id) is None
    c.submit(a.client_id, 0, results(c, a.client_id))
    ids_b = c.assignment_for(b.client_id).sequence_ids
    c.leave(b.client_id)
    assert c.queue.requeued[:len(ids_b)] == list(ids_b)
    assert b.client_id not in c.current_round.assignments
    c.submit(a.client_id, 1, results(c, a.client_id))
    assert c.state.round == 2


def test_every_rejection_leaves_the_master_unchanged(tmp_path, mdat_path):
    c = Coordinator(run_config(tmp_path / "run", mdat_path, min_clients=2), clock=Clock())
    big, _, _ = c.join(caps("big", tier=0))
    small, _, _ = c.join(caps("small", tier=1))
    before = snapshot(c)
    good = results(c, small.client_id)
    wrong_region = [r for r in results(c, big.client_id) if r.name == UP]  # tier 0's region
    nan = dataclasses.replace(good[0], values=torch.full_like(good[0].values, float("nan")))
    unknown = dataclasses.replace(good[0], name="model.layers.9.mlp.up_proj.weight")
    bad = [([unknown], UnknownParameter, 0), (wrong_region, WrongRegion, 0),
           (good, StaleRound, 1), ([nan], MalformedResult, 0),
           ([good[0], good[0]], DuplicateResult, 0)]
    for submission, error, round_index in bad:
        with pytest.raises(error) as caught:
            c.submit(small.client_id, round_index, submission)
        assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert isinstance(caught.value, BadResult) and not c.current_round.submissions
    c.submit(small.client_id, 0, good)
    with pytest.raises(DuplicateResult):
        c.submit(small.client_id, 0, good)
    assert same(c.master, before) and c.phase == "collecting"
    c.submit(big.client_id, 0, results(c, big.client_id, salt=1))
    assert c.state.round == 1 and not same(c.master, before)


def test_ffn_tail_changes_only_through_tier0(tmp_path, mdat_path):
    c = Coordinator(run_config(tmp_path / "run", mdat_path, min_clients=2), clock=Clock())
    big, _, _ = c.join(caps("big", tier=0))
    small, _, _ = c.join(caps("small", tier=1))
    before = snapshot(c)
    half = c.regions(1)[UP][0][1]
    assert half == c.shapes[UP][0] // 2
    lr = c.config.update.lr_at(0, c.config.round.planned_rounds)  # round 0's rate
    big_results = results(c, big.client_id, salt=1)
    small_results = results(c, small.client_id, salt=2)
    g0 = next(r for r in big_results if r.name == UP).values
    c.submit(small.client_id, 0, small_results)
    assert same(c.master, before)
    c.submit(big.client_id, 0, big_results)
    tail = c.master[UP][half:]
    assert torch.equal(tail, torch.add(before[UP][half:], g0[half:], alpha=-lr))
    assert not torch.equal(c.master[UP][:half],
                           torch.add(before[UP][:half], g0[:half], alpha=-lr))


def test_sgd_dense_one_client_is_master_minus_lr_grad(tmp_path, mdat_path):
    c = Coordinator(run_config(tmp_path / "run", mdat_path), clock=Clock())
    a, _, _ = c.join(caps("a"))
    before = snapshot(c)
    lr = c.config.update.lr_at(0, c.config.round.planned_rounds)  # round 0's rate
    c.submit(a.client_id, 0, results(c, a.client_id))
    for name, weight in c.master.items():
        assert torch.equal(weight, torch.add(before[name], gradient(c, name, 0), alpha=-lr))
    logged = c.log.read(0)
    assert logged.hashes == c.tier_hashes(c.config.tiers.allowed) and logged.update.lr == lr


def test_resume_equals_uninterrupted(tmp_path, mdat_path):
    clock = Clock()
    straight = Coordinator(run_config(tmp_path / "a", mdat_path), clock=clock)
    cid = straight.join(caps("a", tier=1))[0].client_id
    drive(straight, clock, cid, 5)

    clock = Clock()
    config = run_config(tmp_path / "b", mdat_path)
    first = Coordinator(config, clock=clock)
    assert first.join(caps("a", tier=1))[0].client_id == cid
    drive(first, clock, cid, 3)
    open_round = first.assignment_for(cid)  # round 3, open when the process "dies"
    del first
    resumed = Coordinator(config, clock=clock)
    assert resumed.state.round == 3 and resumed.state.checkpoints == [0, 2]
    resumed.advance()
    reopened = resumed.assignment_for(cid)  # the same ids, lr, seed and deadline; a new id,
    assert reopened.assignment_id != open_round.assignment_id  # so old results are refused
    assert dataclasses.replace(reopened, assignment_id="") == dataclasses.replace(
        open_round, assignment_id="")
    drive(resumed, clock, cid, 2)
    assert same(resumed.master, straight.master)
    assert resumed.state.tokens == straight.state.tokens
    assert resumed.state.loss == straight.state.loss == {"1": [[r, 1.0] for r in range(5)]}


def test_state_json_is_private_and_keeps_no_session_token(tmp_path, mdat_path, monkeypatch):
    modes = []  # of each temp file, as written, before it becomes state.json
    real = os.replace

    def replace(source, target):
        if Path(target).name == "state.json":
            modes.append(stat.S_IMODE(os.stat(source).st_mode))
        return real(source, target)

    monkeypatch.setattr(os, "replace", replace)
    config = run_config(tmp_path / "run", mdat_path)
    c = Coordinator(config, clock=Clock())
    member, _, token = c.join(caps("a"))
    c.flush()
    path = tmp_path / "run" / "state.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and modes and set(modes) == {0o600}
    assert token.rpartition(".")[2] not in path.read_text()

    # state.json of an older server held the token itself: it resumes, the token still works,
    # and the next save keeps only its hash
    saved = json.loads(path.read_text())
    saved["membership"]["sessions"][member.client_id] = token
    path.write_text(json.dumps(saved))
    resumed = Coordinator(config, clock=Clock())
    assert resumed.authenticate(token) == member.client_id
    resumed.leave(member.client_id)
    resumed.flush()
    assert token.rpartition(".")[2] not in path.read_text()


def test_replay_api_for_a_late_joiner(tmp_path, mdat_path):
    clock = Clock()
    c = Coordinator(run_config(tmp_path / "run", mdat_path), clock=clock)
    cid = c.join(caps("a", tier=1))[0].client_id
    drive(c, clock, cid, 5)
    ref = c.latest_checkpoint()
    assert ref.round == 4 and ref.path.name == "round-4"
    assert (ref.path / "tier1" / "config.json").is_file()  # tier 1's slice
    for folder in (ref.path, ref.path / "tier1"):  # each carries the data's tokenizer
        tokenizer = json.loads((folder / "tokenizer.json").read_text())
        assert tokenizer["model"]["type"] == "BPE" and len(tokenizer["model"]["vocab"]) == 256
        assert "tokenizer.json" in read_manifest(ref.path).common_files
    # the log keeps the rounds since the checkpoint before the latest (round-2)
    with pytest.raises(UpdatesPruned):
        c.updates_since(1)
    assert [u.round for u in c.updates_since(2)] == [2, 3, 4]
    state = {n: t.clone() for n, t in c.master.items()}
    replica = read_weights(ref.path)
    for entry in c.updates_since(ref.round):
        replica = entry.apply(replica)
    assert same(replica, state)


def test_finishes_after_the_planned_rounds_with_a_checkpoint(tmp_path, mdat_path):
    clock = Clock()
    c = Coordinator(run_config(tmp_path / "run", mdat_path, rounds=3), clock=clock)
    cid = c.join(caps("a", tier=1))[0].client_id
    drive(c, clock, cid, 3)
    assert c.phase == "finished" and c.state.checkpoints == [0, 2, 3]
    assert c.current_round is None and c.updates_since(3) == []
    with pytest.raises(StaleRound):
        c.submit(cid, 3, [])


def test_a_finished_run_goes_on_when_its_rounds_are_raised(tmp_path, mdat_path, caplog):
    """Issue 32: resuming a finished 3-round run with [round] rounds = 5 used to say
    "resumed at round 3" and tell every client the run was over. It trains on now, to the
    weights of a run planned for 5 from the start (the schedule is constant); unraised,
    it stays finished and says how to go on."""
    clock = Clock()
    c = Coordinator(run_config(tmp_path / "run", mdat_path, rounds=3), clock=clock)
    cid = c.join(caps("a", tier=1))[0].client_id
    drive(c, clock, cid, 3)
    assert c.phase == "finished"
    del c
    again = Coordinator(run_config(tmp_path / "run", mdat_path, rounds=3), clock=clock)
    assert again.phase == "finished" and again.current_round is None
    assert "to train on, raise [round] rounds or tokens past them" in caplog.text
    del again
    longer = run_config(tmp_path / "run", mdat_path, rounds=5)
    extended = Coordinator(longer, clock=clock)
    assert extended.phase != "finished" and not extended.state.finished
    assert extended.state.events[-1]["kind"] == "extend"
    assert "rounds = 5: training on" in extended.state.events[-1]["detail"]
    assert json.loads((tmp_path / "run" / "state.json").read_text())["finished"] is False
    extended.advance()
    drive(extended, clock, cid, 2)
    assert extended.phase == "finished" and extended.state.round == 5

    straight = Coordinator(run_config(tmp_path / "straight", mdat_path, rounds=5), clock=clock)
    cid = straight.join(caps("a", tier=1))[0].client_id
    drive(straight, clock, cid, 5)
    assert straight.state.tokens == extended.state.tokens
    assert longer.update.schedule == "constant"  # so the lr of each round is the same
    assert same(straight.master, extended.master)


def test_a_run_saved_before_orders_left_sequences_out_keeps_its_order(tmp_path):
    """Queue positions count in the order the run started with: a state.json from before
    targetless sequences were left out resumes over the whole shuffle, and an order whose
    length changed since is refused."""
    import json

    from support.models import TAILS_STRATEGY, mdat_with_one_token_tails

    from matformer.modeling.mdat import Mdat
    from matformer.server.errors import ResumeError
    from matformer.server.ledger import audit_run

    data = mdat_with_one_token_tails(tmp_path / "tails.mdat")
    config = run_config(tmp_path / "run", data)
    config = dataclasses.replace(config, data=dataclasses.replace(
        config.data, strategy=TAILS_STRATEGY, max_seq_len=8))
    with Mdat.open(data) as mdat:
        shuffle = mdat.shuffle(None, TAILS_STRATEGY, 8, config.data.seed)
    fresh = Coordinator(config)
    assert fresh.state.sequences == fresh.queue.order.candidates == len(shuffle) - 40
    state_path = tmp_path / "run" / "state.json"
    state = json.loads(state_path.read_text())
    # saved before runs held out a tail: the shuffle's ids that carry a target, every epoch
    state_path.write_text(json.dumps({k: v for k, v in state.items() if k != "held_out"}))
    targets = Coordinator(config).queue.order
    assert len(targets.held_out) == 0 and targets.seed is None
    assert targets.training.tolist() == [i for i in shuffle.tolist()
                                         if i in set(fresh.queue.order.training.tolist())
                                         | set(fresh.queue.order.held_out.tolist())]
    assert audit_run(config).sequences == len(shuffle) - 40
    # saved before targetless sequences were left out: the whole shuffle
    state_path.write_text(json.dumps({k: v for k, v in state.items()
                                      if k not in ("sequences", "held_out")}))
    legacy = Coordinator(config)
    assert legacy.queue.order.training.tolist() == shuffle.tolist()
    assert audit_run(config).sequences == len(shuffle)
    state_path.write_text(json.dumps(state | {"sequences": 7}))
    with pytest.raises(ResumeError, match="hands out 7 sequences"):
        Coordinator(config)
