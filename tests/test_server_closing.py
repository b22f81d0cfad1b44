"""A round's close runs beside the coordinator's lock (issue 16, build 3): while one thread
aggregates, hashes and writes, every other call is answered."""

from __future__ import annotations

import dataclasses
import threading

import pytest
from support.helpers import Clock, run_config
from support.rounds import caps, committed, disk_full, drive, flat_results, results, same
from support.wire import header_of, joined, serving

import matformer.server.checkpoints as checkpoints_module
import matformer.server.update_steps as update_steps_module
from matformer.modeling.compression import CoefficientStep, CompressionConfig
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.submission import submission_messages
from matformer.protocol.updates import read_updates
from matformer.server.coordinator import Coordinator
from matformer.server.errors import RunDirectoryUnavailable
from matformer.server.update_cache import UpdateCache
from matformer.server.update_log import UpdateLog

UP = "model.layers.0.mlp.up_proj.weight"
WAIT_S = 30.0  # a generous bound on a wait that, with the lock taken, would never end


def test_calls_are_answered_while_a_close_is_under_way(tmp_path, mdat_path, monkeypatch):
    c = Coordinator(run_config(tmp_path / "run", mdat_path, min_clients=2), clock=Clock())
    a = c.join(caps("a"))[0].client_id
    b = c.join(caps("b"))[0].client_id
    entered, release = threading.Event(), threading.Event()
    real = update_steps_module.aggregate

    def slow(results, **kwargs):  # the close's heavy part, held until the test lets it go
        entered.set()
        release.wait(WAIT_S)
        return real(results, **kwargs)

    monkeypatch.setattr(update_steps_module, "aggregate", slow)
    c.submit(a, 0, results(c, a))
    closer = threading.Thread(target=c.submit, args=(b, 0, results(c, b)))
    closer.start()  # b's submission completes the round: this thread closes it
    try:
        assert entered.wait(WAIT_S)
        answered = {}

        def calls():
            answered["heartbeat"] = c.heartbeat(a)  # no assignment while the round closes
            answered["snapshot"] = c.snapshot()["round"]
            answered["joined"] = c.join(caps("late"))[0].name
            c.advance()  # another thread's advance returns at once: one close at a time

        caller = threading.Thread(target=calls)
        caller.start()
        caller.join(WAIT_S)
        assert not caller.is_alive(), "a call waited for the close"
        assert answered == {"heartbeat": None, "snapshot": 0, "joined": "late"}
        assert c.phase == "collecting" and c.state.round == 0
    finally:
        release.set()
        closer.join(WAIT_S)
    assert c.state.round == 1 and c.current_round is not None  # round 1 opened with 3 members
    assert set(c.current_round.assignments) == {a, b, "client-2"}


def test_round_closed_hooks_see_each_round_that_moved_the_master(tmp_path, mdat_path):
    c = Coordinator(run_config(tmp_path / "run", mdat_path), clock=Clock())
    cid = c.join(caps("a", tier=1))[0].client_id
    seen = []
    c.round_closed.append(seen.append)
    for r in range(3):
        c.submit(cid, r, results(c, cid))
    assert [(s.round, s.tiers) for s in seen] == [(0, {1}), (1, {1}), (2, {1})]
    assert seen[-1].after is c.master and seen[1].after is seen[2].before


# -- GetUpdates from memory ----------------------------------------------------------------


def logged_rounds(c: Coordinator, count: int) -> list:
    """The logged update of each of ``count`` rounds, as the closes hand them over."""
    logged = []
    c.round_closed.append(lambda closed: logged.append(closed.update))
    cid = c.join(caps("a", tier=1))[0].client_id
    for r in range(count):
        c.submit(cid, r, results(c, cid))
    return logged


def test_each_round_is_read_and_encoded_once_per_tier(tmp_path, mdat_path):
    c = Coordinator(run_config(tmp_path / "run", mdat_path), clock=Clock())
    logged = logged_rounds(c, 4)
    reads = []
    cache = UpdateCache(read=lambda r: reads.append(r) or logged[r], regions=c.regions)
    cache.put(logged[3])  # as the close hands it over
    first = cache.messages(3, 1)
    assert reads == [] and cache.messages(3, 1) is first  # from memory, encoded once
    assert cache.messages(3, 0) is not first  # each tier its own cut
    header = first[0].header
    assert (header.round, header.weight_hash) == (3, logged[3].hashes[1])
    assert cache.messages(2, 1)[0].header.round == 2 and reads == [2]  # not handed over
    cache.messages(2, 1)
    assert reads == [2]


def test_the_cache_keeps_the_newest_rounds_within_its_budget(tmp_path, mdat_path):
    c = Coordinator(run_config(tmp_path / "run", mdat_path), clock=Clock())
    logged = logged_rounds(c, 4)
    sizes = [sum(m.ByteSize() for m in UpdateCache(read=logged.__getitem__,
                                                   regions=c.regions).messages(r, 0))
             for r in range(4)]
    reads = []
    cache = UpdateCache(read=lambda r: reads.append(r) or logged[r], regions=c.regions,
                        budget=sizes[2] + sizes[3])  # the newest two rounds of tier 0
    for r in range(4):
        cache.messages(r, 0)
    cache.messages(3, 0), cache.messages(2, 0)  # the newest two stayed
    assert reads == [0, 1, 2, 3]
    cache.messages(0, 0)  # left: read again, and it pushes round 2 out
    assert reads == [0, 1, 2, 3, 0]
    tiny = UpdateCache(read=lambda r: reads.append(r) or logged[r], regions=c.regions,
                       budget=1)
    assert tiny.messages(3, 0) is tiny.messages(3, 0)  # the newest round stays whatever size


def test_a_second_download_of_a_round_does_not_read_the_log(tmp_path):
    with serving(tmp_path) as (server, stub):
        member, auth, work = joined(stub, server, "alice")
        c = server.service.coordinator
        for r in range(2):
            stub.SubmitResult(submission_messages(header_of(member, work),
                                                  flat_results(c, member.client_id)),
                              metadata=auth, timeout=10)
            committed(c, r + 1)
            work = stub.GetRound(pb.GetRoundRequest(), metadata=auth)
        first = list(stub.GetUpdates(pb.GetUpdatesRequest(since_round=0), metadata=auth,
                                     timeout=10))
        for path in (c.dir / "updates").glob("round-*.safetensors"):
            path.unlink()  # what is served to the next client comes from memory
        again = list(stub.GetUpdates(pb.GetUpdatesRequest(since_round=0), metadata=auth,
                                     timeout=10))
        assert again == first
        updates = list(read_updates(again, tier=0))
        assert [u.round for u in updates] == [0, 1]
        assert updates[1].hashes == c.tier_hashes([0])  # the master after round 1


def _compressed_broadcast(run_dir, mdat_path):
    """A run whose clients send dense results and whose broadcast keeps 8 DCT coefficients
    per 16 × 16 chunk."""
    base = run_config(run_dir, mdat_path)
    return dataclasses.replace(base, compression=CompressionConfig(encoding="dense", chunk=16),
                               update=dataclasses.replace(base.update, broadcast_topk=8))


def test_a_failed_close_keeps_the_broadcast_residual_and_a_restart_stays_exact(
        tmp_path, mdat_path, monkeypatch):
    clock = Clock()
    straight = Coordinator(_compressed_broadcast(tmp_path / "a", mdat_path), clock=clock)
    cid = straight.join(caps("a", tier=1))[0].client_id
    drive(straight, clock, cid, 4)
    assert straight.carried.residual and isinstance(straight.log.read(3).steps[UP], CoefficientStep)

    clock = Clock()
    c = Coordinator(_compressed_broadcast(tmp_path / "b", mdat_path), clock=clock)
    c.join(caps("a", tier=1))
    drive(c, clock, cid, 3)
    residual = {n: t.clone() for n, t in c.carried.residual.items()}
    with monkeypatch.context() as patch:
        patch.setattr(UpdateLog, "append", disk_full)
        with pytest.raises(RunDirectoryUnavailable):
            drive(c, clock, cid, 1)
    assert same(c.carried.residual, residual) and c.state.round == 3
    c.advance()  # the disk has room again: round 3 closes as it would have
    c.flush()  # (and writes its checkpoint) before another coordinator opens the directory
    assert same(c.master, straight.master) and same(c.carried.residual, straight.carried.residual)
    resumed = Coordinator(c.config, clock=clock)  # closes the logged rounds again
    assert same(resumed.master, c.master) and same(resumed.carried.residual, c.carried.residual)


def test_checkpoints_are_written_while_the_next_rounds_go_on(tmp_path, mdat_path, monkeypatch):
    clock = Clock()
    c = Coordinator(run_config(tmp_path / "run", mdat_path), clock=clock)  # every 2 rounds
    cid = c.join(caps("a"))[0].client_id
    entered, release = threading.Event(), threading.Event()
    real = checkpoints_module.export_tiers

    def slow(*args, **kwargs):  # the universal folder is staged; held until the test says
        entered.set()
        release.wait(WAIT_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(checkpoints_module, "export_tiers", slow)
    for _ in range(2):  # round 1's close starts writing checkpoint round-2
        clock.now += 1.0
        c.submit(cid, c.current_round.index, results(c, cid))
    assert entered.wait(WAIT_S)
    clock.now += 1.0
    c.submit(cid, 2, results(c, cid))  # round 2 opened and closes meanwhile
    assert c.state.round == 3 and c.state.checkpoints == [0]
    assert sorted(p.name for p in (c.dir / "checkpoints").iterdir()) == [
        ".staging-round-2", "round-0"]  # retiring spares the one in progress
    release.set()
    c.flush()  # waits for the write: listed, in state.json too
    assert c.state.checkpoints == [0, 2] and c.latest_checkpoint().path.name == "round-2"
    assert [e["detail"] for e in c.state.events if e["kind"] == "checkpoint"] == [
        "checkpoints/round-2"]
    resumed = Coordinator(c.config, clock=clock)
    assert resumed.state.checkpoints == [0, 2] and same(resumed.master, c.master)


def test_a_checkpoint_that_cannot_be_written_is_left_out_and_the_run_goes_on(
        tmp_path, mdat_path, monkeypatch):
    clock = Clock()
    c = Coordinator(run_config(tmp_path / "run", mdat_path), clock=clock)
    cid = c.join(caps("a"))[0].client_id
    with monkeypatch.context() as patch:
        patch.setattr(checkpoints_module, "save_pretrained", disk_full)
        drive(c, clock, cid, 2)
        c.flush()
    assert c.state.round == 2 and c.state.checkpoints == [0]
    assert [p.name for p in (c.dir / "checkpoints").iterdir() if "round-2" in p.name] == []
    assert "checkpoint round-2 could not be written" in events_of(c, "disk")[-1]
    drive(c, clock, cid, 2)
    c.flush()  # the next checkpoint is written; the log kept every round since round-0
    assert c.state.checkpoints == [0, 4]
    assert same(Coordinator(c.config, clock=clock).master, c.master)


def events_of(c, kind):
    return [e["detail"] for e in c.state.events if e["kind"] == kind]


def test_a_member_that_submitted_is_told_when_work_is_likely(tmp_path, mdat_path):
    """GetRound's WAIT carries the coordinator's estimate: until the slowest other member
    submits (as long after the opening as its last round took) and a close like the last."""
    clock = Clock()
    c = Coordinator(run_config(tmp_path / "run", mdat_path, min_clients=2), clock=clock)
    a = c.join(caps("a"))[0].client_id
    b = c.join(caps("b"))[0].client_id
    assert c.next_work_in(a) is None  # nothing submitted, nothing known
    opened = clock.now
    clock.now = opened + 1.0
    c.submit(a, 0, results(c, a))
    assert c.next_work_in(a) is None  # b has no last round to go by yet
    clock.now = opened + 3.0
    c.submit(b, 0, results(c, b))  # closes round 0 (no time passes on this clock), opens 1
    assert c.state.round == 1
    clock.now += 0.5
    c.submit(a, 1, results(c, a))
    assert c.next_work_in(a) == pytest.approx(3.0 - 0.5)  # b took 3 s last round
    assert c.next_work_in(b) is None  # b has work now
    clock.now += 5.0
    assert c.next_work_in(a) is None  # overdue: no better guess than the default
