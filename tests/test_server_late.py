"""Late results ([round] late_rounds, issue 49): a result that misses its round's deadline is
folded into a later round instead of its sequences being trained again; past the bound its
sequences go back to the queue, as they went at the deadline before."""

from __future__ import annotations

import dataclasses
import math

import pytest
from support.helpers import Clock, checked_tables, run_config
from support.rounds import caps, events, results, same

from matformer.server.config import RunConfig
from matformer.server.coordinator import Coordinator
from matformer.server.errors import InvalidValue, StaleRound
from matformer.server.ledger import TrainedLedger, audit
from matformer.server.state import RunState


def late_run(tmp_path, mdat_path, name="run", **late):
    config = run_config(tmp_path / name, mdat_path, min_clients=2)
    return dataclasses.replace(config, round=dataclasses.replace(
        config.round, **{"late_rounds": 1, **late}))


def started(config, clock):
    """A coordinator with members a and b, round 0 open (and, overlapped, 1 and 2)."""
    c = Coordinator(config, clock=clock)
    a = c.join(caps("a"))[0].client_id
    b = c.join(caps("b"))[0].client_id
    closed = []
    c.round_closed.append(closed.append)
    return c, a, b, closed


def miss_round_0(c, clock, a, b):
    """a delivers round 0, b misses its deadline: b's round-0 assignment."""
    late = c.assignment_for(b)
    assert late.round == 0
    clock.now = 1.0
    c.submit(a, 0, results(c, a), loss=1.0)
    clock.now = late.deadline + 0.1
    c.advance()
    assert c.state.round == 1
    return late


@pytest.mark.parametrize("overlap", [False, True])
def test_a_late_result_is_folded_into_the_next_round_at_its_weight(tmp_path, mdat_path,
                                                                   overlap):
    for weight in (1.0, 0.5):
        clock = Clock()
        c, a, b, closed = started(late_run(tmp_path, mdat_path, f"w{weight}",
                                           late_weight=weight, overlap=overlap), clock)
        late = miss_round_0(c, clock, a, b)
        (drop,) = events(c, "drop")
        assert "may still be folded into the next 1 round(s)" in drop["detail"]
        # b's ids wait for its result: neither trained nor handed out again
        assert not set(late.sequence_ids) & {i for r in c.pipeline.collecting
                                             for x in r.assignments.values()
                                             for i in x.sequence_ids}
        c.submit(b, 0, results(c, b, assignment=late, salt=7), loss=1.0,
                 assignment_id=late.assignment_id)  # late, and kept
        with pytest.raises(StaleRound):  # once
            c.submit(b, 0, results(c, b, assignment=late), assignment_id=late.assignment_id)
        fresh = {x: c.assignment_for(x) for x in (a, b)}
        for x in (a, b):
            c.submit(x, 1, results(c, x), loss=1.0)
        assert c.state.round == 2
        # the close counted b's late tokens, at the weight, besides round 1's own
        own = sum(x.tokens for x in fresh.values())
        coverage = closed[-1].update.coverage_tokens["model.norm.weight"]
        assert coverage == own + max(1, round(late.tokens * weight))
        record = c.state.rounds[-1]
        assert record["late"] == [{"client_id": b, "name": "b", "round": 0,
                                   "tokens": late.tokens, "weight": weight}]
        assert record["tokens"] == own + late.tokens == c.state.tokens - c.state.rounds[0][
            "tokens"]
        ledger = TrainedLedger(c.dir).rounds()
        assert set(late.sequence_ids) <= set(ledger[1]["ids"])
        check = audit(c.queue.order, RunState.load(c.dir).queue, ledger)
        assert check.exactly_once


def test_the_late_result_moves_the_weights(tmp_path, mdat_path):
    """Two runs alike but for the values of b's late result: the masters after the round
    that folds it in differ, so it reached the aggregate."""
    masters = []
    for salt in (7, 8):
        clock = Clock()
        c, a, b, _ = started(late_run(tmp_path, mdat_path, f"s{salt}"), clock)
        late = miss_round_0(c, clock, a, b)
        c.submit(b, 0, results(c, b, assignment=late, salt=salt), loss=1.0)
        for x in (a, b):
            c.submit(x, 1, results(c, x), loss=1.0)
        masters.append(c.master)
    assert not same(*masters)


def test_past_its_bound_a_late_result_is_refused_and_its_sequences_trained_again(
        tmp_path, mdat_path):
    clock = Clock()
    c, a, b, _ = started(late_run(tmp_path, mdat_path), clock)
    late = miss_round_0(c, clock, a, b)
    c.submit(a, 1, results(c, a), loss=1.0)  # round 1 closes without b: it missed round 0
    assert c.state.round == 2 and not c.state.rounds[-1]["late"]
    assert any("did not come within [round] late_rounds (1)" in e["detail"]
               for e in events(c, "drop"))
    with pytest.raises(StaleRound):
        c.submit(b, 0, results(c, b, assignment=late), assignment_id=late.assignment_id)
    # its ids went back to the queue, and the round opened since took them
    handed = [i for r in c.pipeline.collecting for x in r.assignments.values()
              for i in x.sequence_ids] + c.queue.requeued
    assert set(late.sequence_ids) <= set(handed)
    check = audit(c.queue.order, RunState.load(c.dir).queue, TrainedLedger(c.dir).rounds())
    assert check.exactly_once


def test_a_result_past_its_deadline_before_the_round_closes_counts_in_its_own_round(
        tmp_path, mdat_path):
    clock = Clock()
    c, a, b, _ = started(late_run(tmp_path, mdat_path), clock)
    mine = c.assignment_for(b)
    clock.now = 1.0
    c.submit(a, 0, results(c, a), loss=1.0)
    clock.now = mine.deadline + 0.1  # past it, but nothing has closed the round yet
    c.submit(b, 0, results(c, b), loss=1.0)  # the call closes round 0, then takes it late
    c.submit(a, 1, results(c, a), loss=1.0)
    c.submit(b, 1, results(c, b), loss=1.0)
    assert [r["late"] for r in c.state.rounds] == [[], [
        {"client_id": b, "name": "b", "round": 0, "tokens": mine.tokens, "weight": 1.0}]]


def test_held_late_work_survives_a_restart_as_queued_ids(tmp_path, mdat_path):
    """A restarted coordinator knows nothing of late work: the saved queue puts its ids at
    the front, so they are trained again, once, and a late result is refused."""
    clock = Clock()
    config = late_run(tmp_path, mdat_path)
    c, a, b, _ = started(config, clock)
    late = miss_round_0(c, clock, a, b)
    c.flush()
    del c
    resumed = Coordinator(config, clock=clock)
    assert resumed.state.queue["requeued"][:len(late.sequence_ids)] == list(late.sequence_ids)
    assert resumed.queue.requeued[:len(late.sequence_ids)] == list(late.sequence_ids)


def test_a_member_that_leaves_hands_its_late_work_back(tmp_path, mdat_path):
    clock = Clock()
    c, a, b, _ = started(late_run(tmp_path, mdat_path), clock)
    late = miss_round_0(c, clock, a, b)
    c.leave(b, "done")
    assert not c.pipeline.late.held
    assert c.queue.requeued[:len(late.sequence_ids)] == list(late.sequence_ids)


def test_late_rounds_is_off_unless_set_and_the_weight_is_a_share():
    assert RunConfig.from_dict(checked_tables()).round.late_rounds == 0
    for bad in (1.5, 0.0):
        with pytest.raises(InvalidValue, match=r"\[round\] late_weight"):
            RunConfig.from_dict(checked_tables(round={"rounds": 10, "late_weight": bad}))


def test_a_result_arriving_while_its_round_is_being_closed_is_folded_into_the_next(
        tmp_path, mdat_path):
    """Its round left collection for its close without it, and is not yet committed (so
    nothing holds its work yet): the result is kept, and the round behind folds it in."""
    clock = Clock()
    c, a, b, _ = started(late_run(tmp_path, mdat_path), clock)
    mine = c.assignment_for(b)
    c.submit(a, 0, results(c, a), loss=1.0)
    clock.now = mine.deadline + 0.1
    with c._lock:
        closing = c._step(detach=True)
    assert closing is not None and c.pipeline.closing is closing.rnd
    c.submit(b, 0, results(c, b, assignment=mine), loss=1.0)
    c.closer.close(closing)
    assert not c.pipeline.late.held and list(c.pipeline.late.kept) == [mine.assignment_id]
    c.advance()  # round 1 opens
    for x in list(c.pipeline.collecting[0].assignments):  # (b's halved share may be none)
        c.submit(x, 1, results(c, x), loss=1.0)
    assert c.state.round == 2 and [x["round"] for x in c.state.rounds[-1]["late"]] == [0]
    check = audit(c.queue.order, RunState.load(c.dir).queue, TrainedLedger(c.dir).rounds())
    assert check.exactly_once and check.trained == check.handed_out


def test_work_of_a_member_not_waited_for_is_held_for_its_late_result(tmp_path, mdat_path):
    """Once the others are in, a round stops waiting for a member that missed its last round
    (RoundPipeline.drop_refused); with late results on its work there waits for it too, since
    a busy machine is slow rather than gone, and both late results are folded in."""
    clock = Clock()
    c, a, b, _ = started(late_run(tmp_path, mdat_path, late_rounds=3), clock)
    first = miss_round_0(c, clock, a, b)
    second = c.assignment_for(b)
    assert second is not None and second.round == 1
    c.submit(a, 1, results(c, a), loss=1.0)  # round 1 closes without b
    assert c.state.round == 2 and set(c.pipeline.late.held) == {first.assignment_id,
                                                                 second.assignment_id}
    assert "was not waited for" in c.state.rounds[-1]["dropped"][0]["reason"]
    for late in (first, second):
        c.submit(b, late.round, results(c, b, assignment=late), loss=1.0,
                 assignment_id=late.assignment_id)
    for x in list(c.pipeline.collecting[0].assignments):
        c.submit(x, 2, results(c, x), loss=1.0)
    assert [(x["round"], x["weight"]) for x in c.state.rounds[-1]["late"]] == [(0, 1.0),
                                                                               (1, 1.0)]
    check = audit(c.queue.order, RunState.load(c.dir).queue, TrainedLedger(c.dir).rounds())
    assert check.exactly_once and check.trained == check.handed_out


def test_late_results_folded_into_a_round_being_closed_are_in_the_saved_queue(
        tmp_path, mdat_path):
    """state.json saved while a round that folds a late result is being closed (a periodic
    save) lists that result's sequences at the queue's front: a crash before the round
    commits trains them again rather than losing them."""
    clock = Clock()
    config = late_run(tmp_path, mdat_path)
    c, a, b, _ = started(config, clock)
    late = miss_round_0(c, clock, a, b)
    c.submit(b, 0, results(c, b, assignment=late), loss=1.0)  # kept
    rnd = c.pipeline.collecting[0]
    assert rnd.index == 1 and b in rnd.assignments  # it works: round 1 waits for it
    c.submit(a, 1, results(c, a), loss=1.0)
    clock.now = rnd.deadline + 0.1
    with c._lock:
        closing = c._step(detach=True)
        assert closing.rnd is rnd and [f.assignment.round for f in rnd.late] == [0]
        c.save()  # as the periodic save would, mid-close
    del c
    resumed = Coordinator(config, clock=clock)
    assert resumed.state.round == 1
    assert resumed.queue.requeued[:len(late.sequence_ids)] == list(late.sequence_ids)


def test_a_discarded_round_hands_the_late_results_it_folded_back(tmp_path, mdat_path,
                                                                monkeypatch):
    """A round whose update would not be finite is discarded: the late result folded into
    it is not trained either, so its sequences go back to the queue, once."""
    monkeypatch.setattr("matformer.server.limits.MAX_ABS_VALUE", math.inf)
    clock = Clock()
    config = late_run(tmp_path, mdat_path)
    config = dataclasses.replace(  # no peer clipping: the member's values stand as sent
        config, update=dataclasses.replace(config.update, lr=10.0),
        faults=dataclasses.replace(config.faults, peer_clip=0.0))
    c, a, b, _ = started(config, clock)
    late = miss_round_0(c, clock, a, b)
    c.submit(b, 0, results(c, b, assignment=late), loss=1.0)
    huge = results(c, a)
    huge[0].values.fill_(3e38)  # finite, but lr 10 times its share overflows float32
    for x, sent in ((a, huge), (b, results(c, b))):
        c.submit(x, 1, sent, loss=1.0)
    assert "not finite" in events(c, "discard")[0]["detail"] and c.state.round == 1
    handed = [i for r in c.pipeline.collecting for x in r.assignments.values()
              for i in x.sequence_ids] + c.queue.requeued
    assert sorted(set(late.sequence_ids) & set(handed)) == sorted(late.sequence_ids)
    assert not set(late.sequence_ids) & {i for e in TrainedLedger(c.dir).rounds()
                                         for i in e["ids"]}
