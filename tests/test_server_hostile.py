"""A hostile or broken member cannot steer, freeze or corrupt the run, and a run directory
that cannot be written leaves memory and disk as they were (issue 15, findings 1, 2, 4, 5
and the coordinator's share of 6)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from support.helpers import Clock, run_config
from support.rounds import caps, disk_full, drive, events, gradient, results, same

import matformer.server.close as close_module
from matformer.modeling.compression import SparseResult
from matformer.server.coordinator import Coordinator
from matformer.server.errors import (
    BadCapabilities,
    BadReport,
    Excluded,
    ResumeError,
    RunDirectoryUnavailable,
    SessionInvalid,
    ValueTooLarge,
    WrongTokenCount,
)
from matformer.server.ledger import TrainedLedger, audit
from matformer.server.state import RunState
from matformer.server.update_log import UpdateLog

# -- 1. weights come from the assignment, not from what a client claims -----------------------


def test_a_claimed_token_count_does_not_outweigh_an_honest_member(tmp_path, mdat_path):
    clock = Clock()
    c = Coordinator(run_config(tmp_path / "run", mdat_path, min_clients=2), clock=clock)
    honest = c.join(caps("honest"))[0].client_id
    attacker = c.join(caps("attacker"))[0].client_id
    before = {n: t.clone() for n, t in c.master.items()}
    forged = [SparseResult(**{**{f: getattr(r, f) for f in r.__slots__},
                              "values": r.values * -0.1, "tokens": 10**15})
              for r in results(c, attacker)]
    with pytest.raises(WrongTokenCount, match="assignment holds"):
        c.submit(attacker, 0, forged)
    assert c.rejected(attacker, WrongTokenCount("x")) == " (refusal 1 of 3)"  # counted
    c.submit(honest, 0, results(c, honest))
    clock.now = 100.0  # the attacker never delivers: dropped at the deadline
    c.advance()
    assert c.state.round == 1
    for name in before:  # sgd, lr 0.1: the honest gradient alone moved the master
        grad = gradient(c, name, 0)
        region = c.regions(0)[name]
        where = tuple(slice(a, b) for a, b in region)
        torch.testing.assert_close(before[name][where] - c.master[name][where],
                                   0.1 * grad[where])


# -- 2. impossible numbers never reach the round's split or state.json ----------------------


@pytest.mark.parametrize("speed", [math.inf, -math.inf, math.nan, 1e308, -1.0])
def test_an_impossible_speed_is_refused_and_the_run_goes_on(tmp_path, mdat_path, speed):
    config = run_config(tmp_path / "run", mdat_path)
    c = Coordinator(config, clock=Clock())
    with pytest.raises(BadCapabilities, match="tokens/s"):
        c.join(caps("liar", tps=speed))
    member = c.join(caps("honest"))[0].client_id
    assert c.current_round is not None  # a round opens
    with pytest.raises(BadCapabilities, match="tokens/s"):
        c.heartbeat(member, tokens_per_second=speed)
    assert math.isfinite(c.membership.get(member).tokens_per_second)
    c.flush()
    resumed = Coordinator(config, clock=Clock())
    resumed.heartbeat(member)
    assert resumed.current_round is not None


@pytest.mark.parametrize(("rule", "clip", "vote", "steered"), [
    ("sgd", 0.0, "mean", True), ("sgd", 1.0, "mean", False),
    ("sign", 0.0, "mean", True), ("sign", 0.0, "majority", False)])
def test_a_loud_member_steers_unless_clipped_or_outvoted(tmp_path, mdat_path, rule, clip, vote,
                                                        steered):
    """An attacker with the tokens it was assigned but a million times the honest magnitude
    steers every element it covers, unless [faults] peer_clip bounds its magnitude or
    [update] vote = "majority" gives it one vote of three."""
    config = run_config(tmp_path / "run", mdat_path, min_clients=3)
    config = dataclasses.replace(
        config, faults=dataclasses.replace(config.faults, peer_clip=clip),
        update=dataclasses.replace(config.update, rule=rule, vote=vote, lr=1e-3))
    c = Coordinator(config, clock=Clock())
    members = [c.join(caps(name))[0].client_id for name in ("a", "b", "loud")]
    before = {n: t.clone() for n, t in c.master.items()}
    for cid in members[:2]:
        c.submit(cid, 0, results(c, cid))
    loud = [SparseResult(**{**{f: getattr(r, f) for f in r.__slots__},
                            "values": r.values * -1e6}) for r in results(c, members[2])]
    c.submit(members[2], 0, loud)
    assert c.state.round == 1
    name = "model.layers.0.mlp.up_proj.weight"
    moved = (before[name] - c.master[name]).sign()  # along the aggregate (or its sign)
    agrees = float((moved == gradient(c, name, 0).sign()).float().mean())
    assert agrees < 0.01 if steered else agrees > 0.99


def test_claiming_the_fastest_speed_wins_no_more_than_a_typical_share(tmp_path, mdat_path):
    """A new member claiming 1e9 tokens/s (allowed) never delivers: it gets a typical share,
    not every sequence of round after round."""
    clock = Clock()
    c = Coordinator(run_config(tmp_path / "run", mdat_path, min_clients=3), clock=clock)
    honest = [c.join(caps(name, tps=1000.0))[0].client_id for name in ("a", "b")]
    liar = c.join(caps("liar", tps=1e9))[0].client_id
    for _ in range(3):
        rnd = c.current_round
        shares = {cid: len(a.sequence_ids) for cid, a in rnd.assignments.items()}
        assert shares.get(liar, 0) <= sum(shares.values()) / 3 + 1
        assert all(shares.get(h) for h in honest)
        for h in honest:
            c.submit(h, rnd.index, results(c, h), train_seconds=1.0)
        if c.state.round == rnd.index:  # the liar never delivers: its first round waits for it
            clock.now = rnd.deadline
        c.heartbeat(honest[0])
        for cid in (*honest, liar):
            c.membership.heartbeat(cid, now=clock.now)


@pytest.mark.parametrize(("field", "value"), [("train_seconds", 5e-324),
                                              ("train_seconds", -1.0),
                                              ("loss", 1e300), ("loss", -2.0)])
def test_an_impossible_report_in_a_submission_is_refused(tmp_path, mdat_path, field, value):
    config = run_config(tmp_path / "run", mdat_path)
    clock = Clock()
    c = Coordinator(config, clock=clock)
    cid = c.join(caps("a"))[0].client_id
    with pytest.raises(BadReport):
        c.submit(cid, 0, results(c, cid), **{field: value})
    assert c.current_round.index == 0 and not c.current_round.submissions
    c.submit(cid, 0, results(c, cid), train_seconds=1.0, loss=2.0)
    assert c.state.round == 1 and c.current_round.index == 1  # the next round opens
    assert "Infinity" not in (config.run.dir / "state.json").read_text()
    assert Coordinator(config, clock=clock).current_round is None  # resumes, waits for members


def test_a_value_no_healthy_client_sends_is_refused(tmp_path, mdat_path):
    c = Coordinator(run_config(tmp_path / "run", mdat_path), clock=Clock())
    cid = c.join(caps("a"))[0].client_id
    sent = results(c, cid)
    sent[0].values[0, 0] = 1e30
    with pytest.raises(ValueTooLarge, match="magnitude 1e\\+30"):
        c.submit(cid, 0, sent)


def test_an_update_that_is_not_finite_is_discarded_not_served(tmp_path, mdat_path,
                                                               monkeypatch):
    monkeypatch.setattr("matformer.server.limits.MAX_ABS_VALUE", math.inf)  # past the first guard
    config = run_config(tmp_path / "run", mdat_path)
    config = dataclasses.replace(config, update=dataclasses.replace(config.update, lr=2.0))
    c = Coordinator(config, clock=Clock())
    cid = c.join(caps("a"))[0].client_id
    before = {n: t.clone() for n, t in c.master.items()}
    handed = c.current_round.assignments[cid].sequence_ids
    huge = results(c, cid)
    huge[0].values.fill_(3e38)  # finite, but sgd's 2 × 3e38 overflows float32
    c.submit(cid, 0, huge)
    assert same(c.master, before) and c.state.round == 0
    assert "not finite" in events(c, "discard")[0]["detail"]
    assert c.current_round.index == 0  # opened again, with the same sequences
    assert c.current_round.assignments[cid].sequence_ids == handed


# -- 5. names -----------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "kind"), [("x" * 2**20, "cpu"), ("bad\nname", "cpu"),
                                            ("", "cpu"), ("ok", "cuda" * 100),
                                            ("ok", "CPU; drop")],
                         ids=["1MiB-name", "newline", "empty", "long-kind", "odd-kind"])
def test_names_and_device_kinds_are_short_printable_words(tmp_path, mdat_path, name, kind):
    config = run_config(tmp_path / "run", mdat_path)
    c = Coordinator(config, clock=Clock())
    report = caps("x")
    report = type(report)(**{**{f: getattr(report, f) for f in report.__slots__},
                             "name": name, "device_kind": kind})
    with pytest.raises(BadCapabilities):
        c.join(report)
    assert not c.membership.members
    assert (config.run.dir / "state.json").stat().st_size < 2**16


def test_a_burst_of_joins_writes_state_json_once_per_interval(tmp_path, mdat_path,
                                                              monkeypatch):
    config = run_config(tmp_path / "run", mdat_path, min_clients=500)
    config.faults.max_joins_per_minute = 1000  # the join-rate limit is tested on its own
    clock = Clock()
    c = Coordinator(config, clock=clock)
    saves = []
    real = RunState.save
    monkeypatch.setattr(RunState, "save", lambda s, d: (saves.append(1), real(s, d)))
    clock.now = 10.0
    for n in range(200):
        c.join(caps(f"member{n}"))
    assert len(saves) == 1  # the first join's advance, then nothing for a second
    clock.now = 11.5
    c.heartbeat("client-0")
    assert len(saves) == 2
    assert len(RunState.load(config.run.dir).membership["members"]) == 200


# -- 6. (coordinator) a forged token learns nothing of an exclusion --------------------------


def test_only_the_excluded_members_own_token_is_told_why(tmp_path, mdat_path):
    c = Coordinator(run_config(tmp_path / "run", mdat_path), clock=Clock())
    member, _, token = c.join(caps("a"))
    c.exclude(member.client_id, "operator: sent garbage on purpose")
    with pytest.raises(Excluded, match="sent garbage"):
        c.authenticate(token)
    with pytest.raises(SessionInvalid):
        c.authenticate(f"{member.client_id}.forged")


# -- 4. a run directory that cannot be written ---------------------------------------------


WRITES = {
    "update log": (UpdateLog, "append"),
    "ledger": (TrainedLedger, "record"),
    "state.json": (RunState, "save"),
}


@pytest.mark.parametrize("where", list(WRITES))
def test_a_disk_full_close_changes_nothing_and_the_run_goes_on(tmp_path, mdat_path,
                                                               monkeypatch, where):
    clock = Clock()
    straight = Coordinator(run_config(tmp_path / "a", mdat_path), clock=clock)
    cid = straight.join(caps("a", tier=1))[0].client_id
    drive(straight, clock, cid, 6)

    clock = Clock()
    config = run_config(tmp_path / "b", mdat_path)  # checkpoints every 2 rounds
    c = Coordinator(config, clock=clock)
    c.join(caps("a", tier=1))
    drive(c, clock, cid, 3)  # round 3 is open; its close writes checkpoint round-4
    master = {n: t.clone() for n, t in c.master.items()}
    state = (config.run.dir / "state.json").read_text()
    files = sorted(p.relative_to(config.run.dir).as_posix()
                   for p in config.run.dir.rglob("*") if p.is_file())
    with monkeypatch.context() as patch:
        patch.setattr(*WRITES[where], disk_full)
        with pytest.raises(RunDirectoryUnavailable, match="No space left on device"):
            drive(c, clock, cid, 1)  # the submission is taken; the close cannot be written
        with pytest.raises(RunDirectoryUnavailable):
            c.advance()  # tried again, refused again, said once
    assert same(c.master, master) and c.state.round == 3
    assert c.current_round.index == 3 and cid in c.current_round.submissions
    assert (config.run.dir / "state.json").read_text() == state
    assert sorted(p.relative_to(config.run.dir).as_posix()
                  for p in config.run.dir.rglob("*") if p.is_file()) == files
    assert len(events(c, "disk")) == 1

    c.advance()  # space again: round 3 closes
    c.flush()  # and its checkpoint, written beside the next round, is listed
    assert c.state.round == 4 and c.state.checkpoints == [0, 2, 4]
    drive(c, clock, cid, 2)
    assert same(c.master, straight.master)
    resumed = Coordinator(config, clock=clock)
    assert same(resumed.master, straight.master)
    entries = TrainedLedger(config.run.dir).rounds()
    assert [e["round"] for e in entries] == [0, 1, 2, 3, 4, 5]
    assert audit(resumed.queue.order, RunState.load(config.run.dir).queue, entries).exactly_once


class RecordingTracker:
    def __init__(self) -> None:
        self.steps: list[int] = []

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.steps.append(step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def test_the_tracker_hears_of_a_round_only_once_state_json_holds_it(tmp_path, mdat_path,
                                                                    monkeypatch):
    clock = Clock()
    c = Coordinator(run_config(tmp_path / "run", mdat_path), clock=clock)
    cid = c.join(caps("a", tier=1))[0].client_id
    c.closer.tracker = tracker = RecordingTracker()
    drive(c, clock, cid, 2)
    assert tracker.steps == [1, 2]
    with monkeypatch.context() as patch:
        patch.setattr(RunState, "save", disk_full)
        with pytest.raises(RunDirectoryUnavailable):
            drive(c, clock, cid, 1)
    assert tracker.steps == [1, 2]  # round 2 was not saved: the tracker never heard of it
    c.advance()
    assert c.state.round == 3 and tracker.steps == [1, 2, 3]


def test_no_round_opens_without_room_to_close_it(tmp_path, mdat_path, monkeypatch):
    c = Coordinator(run_config(tmp_path / "run", mdat_path), clock=Clock())
    real = close_module.shutil.disk_usage
    monkeypatch.setattr(close_module.shutil, "disk_usage",
                        lambda path: real(path)._replace(free=1024))
    cid = c.join(caps("a"))[0].client_id
    c.heartbeat(cid)
    assert c.current_round is None and len(events(c, "disk")) == 1
    assert "needed to close a round" in events(c, "disk")[0]["detail"]
    monkeypatch.setattr(close_module.shutil, "disk_usage", real)
    c.heartbeat(cid)
    assert c.current_round is not None


def test_temp_files_a_kill_left_are_removed_on_start(tmp_path, mdat_path):
    config = run_config(tmp_path / "run", mdat_path)
    clock = Clock()
    c = Coordinator(config, clock=clock)
    cid = c.join(caps("a"))[0].client_id
    drive(c, clock, cid, 2)
    run = config.run.dir
    left = [run / ".state.json.tmp-1a2b3c4d", run / ".trained.jsonl.tmp",
            run / "updates" / ".round-1.safetensors.tmp-deadbeef",
            run / "checkpoints" / ".round-2.old-0123abcd" / "model.safetensors"]
    for path in left:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half")
    kept = sorted(p for p in run.rglob("*") if p.is_file() and p not in left)
    Coordinator(config, clock=clock)
    assert not any(p.exists() for p in left)
    assert not (run / "checkpoints" / ".round-2.old-0123abcd").exists()
    assert sorted(p for p in run.rglob("*") if p.is_file()) == kept
    assert json.loads((run / "state.json").read_text())["round"] == 2


def test_a_state_json_holding_infinity_is_refused_on_resume(tmp_path, mdat_path):
    config = run_config(tmp_path / "run", mdat_path)
    c = Coordinator(config, clock=Clock())
    c.join(caps("a"))
    c.flush()
    path = config.run.dir / "state.json"
    text = path.read_text()
    path.write_text(text.replace('"tokens_per_second": 1000.0', '"tokens_per_second": Infinity'))
    with pytest.raises(ResumeError, match="Infinity"):
        Coordinator(config, clock=Clock())
    c.state.loss["0"] = [[0, math.inf]]
    with pytest.raises(ValueError):  # never written
        c.state.save(config.run.dir)
