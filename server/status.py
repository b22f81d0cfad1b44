"""What the status API and the dashboard show of a run, as one consistent copy
(``Coordinator.snapshot``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matformer.server.coordinator import Coordinator


def snapshot(c: Coordinator, *, since_round: int | None = 0, events_after: int | None = -1
             ) -> dict[str, Any]:
    """One consistent copy of what the status API shows (server/api.py), taken under the
    coordinator's lock, that the gRPC threads change the run under: plain data, safe to read
    after.
    Loss points and round records from ``since_round`` on, events after seq
    ``events_after``; None leaves them out (records are never changed once written, so
    the copies are shallow)."""
    with c._lock:  # reentrant: Coordinator.snapshot holds it already
        rnd = c.current_round
        opened = None if rnd is None else {
            "round": rnd.index, "opened_at": rnd.opened_at, "deadline": rnd.deadline,
            "assigned": sorted(rnd.assignments), "submitted": sorted(rnd.submissions),
            "tokens": sum(a.tokens for a in rnd.assignments.values())}
        return {
            "now": c.clock(), "run_id": c.config.run.id, "phase": c.phase,
            "round": c.state.round, "tokens": c.state.tokens,
            "rounds_planned": c.config.round.rounds,
            "tokens_planned": c.config.round.tokens,
            "min_clients": c.config.round.min_clients,
            "heartbeat_timeout_s": c.config.faults.heartbeat_timeout_s,
            "allowed_tiers": list(c.config.tiers.allowed),
            "checkpoints": list(c.state.checkpoints), "open_round": opened,
            "members": [dataclasses.asdict(m) for m in c.membership.members.values()],
            "excluded": [{"client_id": client, "reason": why,
                          "name": c.membership.excluded_names.get(client, "")}
                         for client, why in c.membership.excluded.items()],
            **c.history.since(round_index=since_round, events_after=events_after)}

