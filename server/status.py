"""What the status API and the dashboard show of a run, as one consistent copy
(``Coordinator.snapshot``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matformer.server.config import RunConfig
    from matformer.server.history import RunHistory
    from matformer.server.membership import Membership
    from matformer.server.rounds import OpenRound
    from matformer.server.state import RunState


def snapshot(config: RunConfig, state: RunState, membership: Membership, history: RunHistory,
             rnd: OpenRound | None, *, phase: str, now: float, since_round: int | None = 0,
             events_after: int | None = -1) -> dict[str, Any]:
    """(the coordinator's lock held: the gRPC threads change these under it) One consistent
    copy of what the status API shows (server/api.py): plain data, safe to read after.
    ``rnd``: the round open now, if any. Loss points and round records from ``since_round``
    on, events after seq ``events_after``; None leaves them out (records are never changed
    once written, so the copies are shallow)."""
    opened = None if rnd is None else {
        "round": rnd.index, "opened_at": rnd.opened_at, "deadline": rnd.deadline,
        "assigned": sorted(rnd.assignments), "submitted": sorted(rnd.submissions),
        "tokens": sum(a.tokens for a in rnd.assignments.values())}
    return {
        "now": now, "run_id": config.run.id, "phase": phase,
        "round": state.round, "tokens": state.tokens,
        "rounds_planned": config.round.rounds,
        "tokens_planned": config.round.tokens,
        "min_clients": config.round.min_clients,
        "heartbeat_timeout_s": config.faults.heartbeat_timeout_s,
        "allowed_tiers": list(config.tiers.ids()),
        "layer_mixes": [list(layers) for layers in config.tiers.layer_mixes],
        "checkpoints": list(state.checkpoints), "open_round": opened,
        "members": [m.record() for m in membership.members.values()],
        "excluded": [{"client_id": client, "reason": why,
                      "name": membership.excluded_names.get(client, "")}
                     for client, why in membership.excluded.items()],
        **history.since(round_index=since_round, events_after=events_after)}
