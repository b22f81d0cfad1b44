"""Who is in the run: members by client id, their tier, speed and when they were last seen.

A member's ``tokens_per_second`` starts at its capability report and is replaced by what it
shows: the tokens of its assignment over the time from the round's opening to its
submission. The coordinator splits each round's sequences by these speeds. Session tokens
live in ``protocol.auth.SessionTokens``; they are saved with the members so that a
restarted coordinator still knows its clients.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from matformer.protocol.auth import SessionTokens
from matformer.server.errors import UnknownClient
from matformer.server.tiers import Capabilities, TierAssignment, TierPolicy


@dataclass(kw_only=True, slots=True)
class Member:
    client_id: str  # "client-<n>", never reused within a run
    name: str  # the name the client reported ([tiers.pins] matches it)
    device_kind: str
    tier: int
    tier_reason: str  # one sentence: why this tier
    tokens_per_second: float  # measured when it has submitted, else its own report
    last_seen: float  # clock time of its last call
    # the longest time between two of its calls since it joined: near [faults]
    # heartbeat_timeout_s, the timeout is tight for this machine
    longest_silence_s: float = 0.0
    measured_by_round: bool = False  # tokens_per_second comes from a submitted round
    memory_bytes: int = 0  # what it reported at join: re-tiering checks a larger tier fits
    microbatch_tokens: int = 0
    requested_tier: int | None = None
    missed: int = 0  # consecutive rounds it was dropped from at the deadline (or hung)
    silence_counted: float | None = None  # last_seen of the silence already counted a miss
    early: int = 0  # consecutive rounds it finished within [faults] early_fraction
    rejections: int = 0  # submissions refused as bad results, over the whole run
    # contribution scores (server/scores.py): its last round's agreement with its peers
    # (None: that round was not scored), its last [faults] score_rounds scores, their mean
    score: float | None = None
    scores: list[float] = field(default_factory=list)
    score_mean: float | None = None
    device_name: str = ""  # what it reported, e.g. "NVIDIA H100 80GB HBM3"; "" if it did not
    last_round: int | None = None  # the last completed round it delivered in
    last_round_tokens: int = 0  # its tokens in that round
    last_round_share: float = 0.0  # ... as a fraction of the round's tokens
    last_round_seconds: float = 0.0  # from the round's opening to its submission
    # Tokens per second of wall time from when it could start a round's work (the round's
    # opening, or its previous submission) to its results: training and everything around
    # it (fetching, sending, a busy machine's pauses). 0 until it has delivered a round.
    delivered_per_second: float = 0.0
    last_delivered_at: float = 0.0
    key_hash: str = ""  # the hash of the client key it joined with ([auth] mode = "keys")
    # What it cost, since it joined: bytes each way as the service sent and received them,
    # against float32 of its tier's weights per submission (up) and per round update
    # served (down); the training seconds it reported, in all and in its last round.
    bytes_up: int = 0
    bytes_down: int = 0
    dense_bytes_up: int = 0
    dense_bytes_down: int = 0
    compute_s: float = 0.0
    last_round_compute_s: float = 0.0
    relay: bool = False  # submits partial sums of its own members (docs/architecture.md)
    # a relay's members, as its last heartbeat listed them: name, tier, tokens_per_second
    relayed: list[dict[str, Any]] = field(default_factory=list)
    # a relay's: every tier it has listed a member at; its losses per tier name only these
    relayed_tiers: list[int] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        """Every field as plain data, safe to read once the lock is let go: the lists
        copied (``dataclasses.asdict`` copies deep, ten times slower; read under the
        coordinator's lock for every member on every status request and save, that held
        heartbeats up at a thousand members). A relay's ``relayed`` is replaced whole at
        each beat, never changed in place, so its entries are shared."""
        return {f: (list(v) if isinstance(v := getattr(self, f), list) else v)
                for f in _MEMBER_FIELDS}


_MEMBER_FIELDS = tuple(f.name for f in dataclasses.fields(Member))


class Membership:
    """Join, heartbeat, leave and speed measurement over the run's members."""

    def __init__(self, policy: TierPolicy, *, members: Sequence[Member] = (),
                 sessions: dict[str, str] | None = None, next_id: int = 0,
                 excluded: dict[str, str] | None = None,
                 excluded_names: dict[str, str] | None = None,
                 excluded_keys: dict[str, str] | None = None) -> None:
        self.policy = policy
        self.members = {m.client_id: m for m in members}
        self.sessions = SessionTokens(sessions)
        self.excluded = dict(excluded or {})  # client id → why it was excluded from the run
        self.excluded_names = dict(excluded_names or {})  # client id → the name it joined as
        self.excluded_keys = dict(excluded_keys or {})  # client key hash → why it was excluded
        self._next_id = next_id

    def join(self, capabilities: Capabilities, *, now: float, key_hash: str = "",
             tier: TierAssignment | None = None) -> tuple[Member, TierAssignment, str]:
        """A new member (its tier from the policy, unless ``tier`` gives it), its assignment
        and its session token."""
        assignment = tier if tier is not None else self.policy.assign(
            capabilities, [m.tier for m in self.members.values()])
        client_id = f"client-{self._next_id}"
        self._next_id += 1
        member = Member(client_id=client_id, name=capabilities.name,
                        device_kind=capabilities.device_kind,
                        device_name=capabilities.device_name, tier=assignment.tier,
                        tier_reason=assignment.reason,
                        tokens_per_second=capabilities.tokens_per_second, last_seen=now,
                        memory_bytes=capabilities.memory_bytes,
                        microbatch_tokens=capabilities.microbatch_tokens,
                        requested_tier=capabilities.requested_tier, key_hash=key_hash,
                        relay=capabilities.relay)
        self.members[client_id] = member
        return member, assignment, self.sessions.issue(client_id)

    def snapshot(self) -> dict[str, Member]:
        """The members as they are (copies), to ``restore``."""
        return copy.deepcopy(self.members)

    def restore(self, snapshot: dict[str, Member]) -> None:
        self.members = snapshot

    def named(self, name: str) -> Member | None:
        """The member called ``name``, if any (the coordinator keeps names unique)."""
        return next((m for m in self.members.values() if m.name == name), None)

    def get(self, client_id: str) -> Member:
        if client_id not in self.members:
            raise UnknownClient(f"{client_id} is not a member of this run (it left, or never "
                                "joined); call Join again.")
        return self.members[client_id]

    def heartbeat(self, client_id: str, *, now: float) -> Member:
        member = self.get(client_id)
        now = max(now, member.last_seen)  # a beat the heartbeat process dated earlier
        member.longest_silence_s = max(member.longest_silence_s, now - member.last_seen)
        member.last_seen = now
        return member

    def leave(self, client_id: str) -> Member:
        member = self.get(client_id)
        del self.members[client_id]
        self.sessions.revoke(client_id)
        return member

    def exclude(self, client_id: str, reason: str) -> Member:
        """Remove a member for good. Its session token stays known, so that its later calls
        (and a Join presenting it) are told ``reason`` (PERMISSION_DENIED) instead of being
        asked to rejoin; a token that was never issued learns nothing. A member that joined
        with a client key loses the key too."""
        member = self.get(client_id)
        del self.members[client_id]
        self.excluded[client_id] = reason
        self.excluded_names[client_id] = member.name
        if member.key_hash:
            self.excluded_keys[member.key_hash] = reason
        return member

    def reported(self, client_id: str, tokens_per_second: float) -> None:
        """The speed a member measured itself; kept until a round measures it (a member that
        has already submitted keeps the speed it showed)."""
        member = self.get(client_id)
        if not member.measured_by_round and tokens_per_second > 0:
            member.tokens_per_second = tokens_per_second

    def measured(self, client_id: str, tokens: int, elapsed_s: float) -> None:
        """Record the speed a member showed; a zero interval (same clock tick) keeps the old."""
        if elapsed_s > 0 and tokens > 0:
            self.members[client_id].tokens_per_second = tokens / elapsed_s
            self.members[client_id].measured_by_round = True

    def active(self, *, now: float, timeout_s: float) -> list[Member]:
        """Members seen within ``timeout_s``, in join order (ids sort by number)."""
        alive = [m for m in self.members.values() if now - m.last_seen <= timeout_s]
        return sorted(alive, key=lambda m: int(m.client_id.rpartition("-")[2]))

    def tiers(self) -> list[int]:
        return sorted({m.tier for m in self.members.values()})

    def to_dict(self) -> dict[str, Any]:
        return {"next_id": self._next_id,
                "members": [m.record() for m in self.members.values()],
                "sessions": self.sessions.as_dict(), "excluded": dict(self.excluded),
                "excluded_names": dict(self.excluded_names),
                "excluded_keys": dict(self.excluded_keys)}

    @classmethod
    def from_dict(cls, policy: TierPolicy, data: dict[str, Any]) -> Membership:
        return cls(policy, members=[Member(**m) for m in data["members"]],
                   sessions=data["sessions"], next_id=data["next_id"],
                   excluded=data.get("excluded", {}),
                   excluded_names=data.get("excluded_names", {}),
                   excluded_keys=data.get("excluded_keys", {}))
