"""The run's history as the status API shows it: events, per-tier loss, round records and
departed members, kept (bounded) in state.json's lists.

Records are plain dicts (state.json holds them as they are) built here only, so their keys
have one home; ``server/api.py`` validates them into its response models. A record is never
changed once appended, so copies of the lists may be shallow.

    history = RunHistory(lambda: coordinator.state, clock)
    history.event("join", client_id, "joined at tier 1")
    history.round(rnd, by_name, close_s=s)  # the closed round's record
    history.since(round_index=5, events_after=12)
"""

from __future__ import annotations

import bisect
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypeVar

from matformer.modeling.compression import DENSE_BYTES_PER_VALUE, SparseResult, region_shape
from matformer.server.membership import Member
from matformer.server.rounds import OpenRound
from matformer.server.state import RunState

EventKind = Literal["join", "leave", "drop", "retier", "exclude", "expire", "reject",
                    "checkpoint", "data", "disk", "discard", "resume", "extend", "size"]
MAX_EVENTS = 1000  # the newest events state.json keeps
MAX_DEPARTED = 100  # the newest departed members state.json keeps
MAX_ROUND_RECORDS = 10_000  # the newest round records state.json keeps (~300 bytes each)
log = logging.getLogger("matformer.server")
T = TypeVar("T")


class RunHistory:
    def __init__(self, state: Callable[[], RunState], clock: Callable[[], float]) -> None:
        self._state = state  # the coordinator's current RunState (a failed close swaps it)
        self._clock = clock

    def event(self, kind: EventKind, who: Member | str | None, detail: str) -> None:
        """One line of the run's history (joins, leaves, drops, re-tierings, exclusions,
        checkpoints, sequences left out of the data) about a member (or its client id when
        it is no longer one), or about none; the log gets it too, naming the member as it
        names itself."""
        state = self._state()
        seq = state.events[-1]["seq"] + 1 if state.events else 0
        client_id, name = (who.client_id, who.name) if isinstance(who, Member) else (who, None)
        state.events.append({"seq": seq, "time": self._clock(), "round": state.round,
                             "kind": kind, "client_id": client_id, "name": name,
                             "detail": detail})
        del state.events[:-MAX_EVENTS]
        said = f"{name} ({client_id})" if name else client_id or "-"
        log.info("round %d: %s %s: %s", state.round, kind, said, detail)

    def departed(self, member: Member, why: str) -> None:
        """What the status API showed of a member that left, with why. One record per name:
        a member that leaves again replaces its record (``leaves`` counts every time), so
        the list holds the newest MAX_DEPARTED members; older ones are only counted."""
        state = self._state()
        before = [d for d in state.departed if d["name"] == member.name]
        state.departed[:] = [d for d in state.departed if d["name"] != member.name]
        state.departed.append({
            "client_id": member.client_id, "name": member.name, "tier": member.tier,
            "device_kind": member.device_kind, "device_name": member.device_name,
            "tokens_per_second": member.tokens_per_second, "last_round": member.last_round,
            "left_at": self._clock(), "round": state.round, "reason": why,
            "leaves": 1 + sum(d["leaves"] for d in before)})
        state.departed_beyond += max(len(state.departed) - MAX_DEPARTED, 0)
        del state.departed[:-MAX_DEPARTED]

    def loss(self, rnd: OpenRound) -> None:
        """Per tier, the token-weighted mean loss its clients reported in ``rnd``: a member's
        at its tier, a relay's members' at theirs (``Submission.tier_losses``)."""
        sums: dict[int, list[float]] = {}
        for client, sub in rnd.submissions.items():
            a = rnd.assignments[client]
            own = {} if sub.loss is None else {a.tier: (sub.loss, a.tokens)}
            for tier, (loss, tokens) in (sub.tier_losses or own).items():
                total = sums.setdefault(tier, [0.0, 0.0])
                total[0] += loss * tokens
                total[1] += tokens
        state = self._state()
        for tier, (weighted, tokens) in sorted(sums.items()):
            if tokens:
                state.loss.setdefault(str(tier), []).append([rnd.index, weighted / tokens])

    def round(self, rnd: OpenRound, by_name: Mapping[str, Sequence[SparseResult]],
              scores: Mapping[str, float], *, close_s: float) -> None:
        """The completed round: duration, slowest client, how long its close took, bytes as
        sent against their dense float32 size, who was dropped, each scored result's
        agreement with its peers' (server/scores.py), the late results it folded in."""
        now = self._clock()
        took = {c: s.received_at - rnd.opened_at for c, s in rnd.submissions.items()}
        slowest = max(took, key=took.__getitem__)
        names = rnd.names  # a member that left since keeps its name here
        state = self._state()
        state.rounds.append({
            "round": rnd.index, "opened_at": rnd.opened_at, "closed_at": now,
            "duration_s": now - rnd.opened_at,
            "tokens": sum(a.tokens for a in rnd.assignments.values())
            + sum(f.assignment.tokens for f in rnd.late),
            "clients": len(rnd.assignments),
            "slowest_client_id": slowest, "slowest_name": names.get(slowest, slowest),
            "slowest_s": took[slowest], "close_s": close_s,
            "bytes_sent": sum(s.wire_bytes for s in [*rnd.submissions.values(),
                                                     *(f.submission for f in rnd.late)]),
            "bytes_dense": sum(DENSE_BYTES_PER_VALUE * math.prod(region_shape(r.region))
                               for results in by_name.values() for r in results),
            "dropped": [{"client_id": c, "name": names.get(c, c), "reason": why}
                        for c, why in rnd.dropped.items()],
            "scores": [{"client_id": c, "name": names.get(c, c), "score": score}
                       for c, score in scores.items()],
            # results of earlier rounds folded in, each at its weight ([round] late_rounds)
            "late": [{"client_id": f.assignment.client_id,
                      "name": names.get(f.assignment.client_id, f.assignment.client_id),
                      "round": f.assignment.round, "tokens": f.assignment.tokens,
                      "weight": f.weight} for f in rnd.late],
        })
        del state.rounds[:-MAX_ROUND_RECORDS]

    def since(self, *, round_index: int | None, events_after: int | None) -> dict[str, Any]:
        """Shallow copies for a snapshot: loss points and round records from
        ``round_index`` on, events after seq ``events_after``; None leaves them out."""
        state = self._state()
        return {
            "departed": list(state.departed), "departed_beyond": state.departed_beyond,
            "last_loss": {tier: points[-1] for tier, points in state.loss.items() if points},
            "loss": {} if round_index is None else {
                tier: _tail(points, round_index, lambda p: p[0])
                for tier, points in state.loss.items()},
            "rounds": [] if round_index is None else _tail(
                state.rounds, round_index, lambda r: r["round"]),
            "events": [] if events_after is None else _tail(
                state.events, events_after + 1, lambda e: e["seq"])}


def _tail(records: list[T], first: int, key: Callable[[T], int]) -> list[T]:
    """The records whose key is ``first`` or more, of a list in ascending key order."""
    return records[bisect.bisect_left(records, first, key=key):]
