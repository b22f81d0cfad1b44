"""A round's close runs beside the coordinator's lock (issue 16, build 3): while one thread
aggregates, hashes and writes, every other call is answered."""

from __future__ import annotations

import threading

import server.coordinator as coordinator_module
from server.coordinator import Coordinator
from tests.test_server_core import Clock, caps, results, run_config

WAIT_S = 30.0  # a generous bound on a wait that, with the lock taken, would never end


def test_calls_are_answered_while_a_close_is_under_way(tmp_path, mdat_path, monkeypatch):
    c = Coordinator(run_config(tmp_path / "run", mdat_path, min_clients=2), clock=Clock())
    a = c.join(caps("a"))[0].client_id
    b = c.join(caps("b"))[0].client_id
    entered, release = threading.Event(), threading.Event()
    real = coordinator_module.aggregate

    def slow(results, **kwargs):  # the close's heavy part, held until the test lets it go
        entered.set()
        release.wait(WAIT_S)
        return real(results, **kwargs)

    monkeypatch.setattr(coordinator_module, "aggregate", slow)
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
