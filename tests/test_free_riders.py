"""Members that take more than they give: free riders (work taken, nothing delivered) cost a
round its deadline once, then the round closes as soon as the others are in, and [faults]
max_misses rounds in a row without a delivery exclude them; a relay files losses only under
its members' tiers."""

from __future__ import annotations

import dataclasses

import pytest
from support.helpers import Clock, run_tables
from support.rounds import caps, results

from matformer.server.config import RunConfig
from matformer.server.coordinator import Coordinator
from matformer.server.errors import BadReport, Excluded, StaleRound

DEADLINE_S = 10.0


def coordinator(tmp_path, mdat_path, clock: Clock, members: int, **faults) -> Coordinator:
    return Coordinator(RunConfig.from_dict(run_tables(
        mdat_path, run={"id": "test", "dir": str(tmp_path / "run")},
        round={"min_clients": members, "deadline_s": DEADLINE_S, "tokens_per_round": 2048,
               "rounds": 20}, faults=faults)), clock=clock)


def test_a_free_rider_costs_one_deadline_then_none_and_is_excluded(tmp_path, mdat_path):
    clock = Clock()
    c = coordinator(tmp_path, mdat_path, clock, 3, max_misses=3, miss_limit=0)
    honest = c.join(caps("honest"))[0].client_id
    riders = [c.join(caps(f"rider{i}"))[0].client_id for i in range(2)]
    waited = []
    for round_index in range(3):
        opened = clock.now
        for rider in riders:
            if rider in c.membership.members:
                c.heartbeat(rider)  # alive, holding work, never submitting
        assert all(c.assignment_for(r) is not None for r in riders)
        clock.now += 1.0
        c.submit(honest, round_index, results(c, honest), loss=1.0)
        if c.state.round == round_index:  # still waiting: the riders hold work
            clock.now = opened + DEADLINE_S
            c.advance()
        assert c.state.round == round_index + 1
        waited.append(clock.now - opened)
    assert waited == [DEADLINE_S, 1.0, 1.0]  # one deadline, then the honest pace
    assert not set(riders) & set(c.membership.members)  # excluded after 3 misses in a row
    reasons = {e["client_id"]: e["detail"] for e in c.state.events if e["kind"] == "exclude"}
    assert all("max_misses" in reasons[r] for r in riders)
    with pytest.raises(Excluded):
        c.authenticate(c.membership.sessions.issue(riders[0]))
    assert c.phase == "waiting"  # one member left of min_clients 3


def test_a_member_that_missed_once_and_then_delivers_is_counted_again(tmp_path, mdat_path):
    """Not waited for after a miss is no punishment for delivering: a member that delivers
    with the others keeps its place and its misses start again."""
    clock = Clock()
    c = coordinator(tmp_path, mdat_path, clock, 2, max_misses=2, miss_limit=0)
    a, b = (c.join(caps(name))[0].client_id for name in ("a", "b"))
    clock.now += 1.0
    c.submit(a, 0, results(c, a), loss=1.0)
    clock.now += DEADLINE_S
    c.advance()  # b missed round 0
    assert c.membership.get(b).missed == 1
    clock.now += 1.0
    c.submit(b, 1, results(c, b), loss=1.0)
    c.submit(a, 1, results(c, a), loss=1.0)
    assert c.state.round == 2 and c.membership.get(b).missed == 0


def test_a_relay_files_losses_only_under_the_tiers_it_listed_members_at(tmp_path, mdat_path):
    """Any holder of the join token can join as a relay: its losses per tier go on the run's
    record only under tiers its heartbeats listed a member at."""
    clock = Clock()
    c = coordinator(tmp_path, mdat_path, clock, 1)
    relay = c.join(dataclasses.replace(caps("relay"), relay=True))[0].client_id
    c.heartbeat(relay, relayed=[("m0", 1, 500.0)])
    assigned = c.assignment_for(relay)
    with pytest.raises(BadReport, match="tier 0 at which the relay listed no member"):
        c.submit(relay, 0, results(c, relay), loss=0.0,
                 tier_losses=[(0, assigned.tokens, 0.0)])
    c.submit(relay, 0, results(c, relay), loss=2.0, tier_losses=[(1, assigned.tokens, 2.0)])
    assert c.state.round == 1 and c.state.loss == {"1": [[0, 2.0]]}


def test_a_slow_member_whose_late_results_arrive_is_still_waited_for(tmp_path, mdat_path):
    """A member that missed a round but handed its results in late shows it works: the next
    round waits for it as for anyone (a free rider hands nothing in)."""
    clock = Clock()
    c = coordinator(tmp_path, mdat_path, clock, 2, max_misses=2, miss_limit=0)
    a, b = (c.join(caps(name))[0].client_id for name in ("a", "b"))
    late = results(c, b)
    clock.now += 1.0
    c.submit(a, 0, results(c, a), loss=1.0)
    clock.now += DEADLINE_S
    c.advance()  # b missed round 0
    with pytest.raises(StaleRound):
        c.submit(b, 0, late, loss=1.0)  # ... and its results came after all
    clock.now += 1.0
    c.submit(a, 1, results(c, a), loss=1.0)
    assert c.state.round == 1 and c.assignment_for(b) is not None  # waited for
    clock.now += 1.0
    c.submit(b, 1, results(c, b), loss=1.0)
    assert c.state.round == 2 and c.membership.get(b).missed == 0
