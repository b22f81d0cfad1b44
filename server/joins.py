"""Membership over time: who may join under which name, how fast joins may come, and how a
member leaves, is excluded or its session expires (docs/architecture.md, "Members that fail
or misbehave"). ``Admissions`` owns the join bucket and changes the membership, the rounds
in flight (a member's unsubmitted work goes back) and the history; every method is called
with the coordinator's lock held.

    admissions = Admissions(membership, pipeline, history, config.faults, clock=...,
                            save=..., mark_unsaved=...)
    member, tier, token = admissions.join(capabilities)
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from matformer.protocol.auth import tokens_equal
from matformer.server.errors import (
    Excluded,
    JoinRefused,
    JoinsTooFast,
    KeysUnreadable,
    NameTaken,
    RoleNotGranted,
    RunFull,
    WrongJoinToken,
)
from matformer.server.keys import KeyFile, KeyFileError, KeyHolder
from matformer.server.membership import Member
from matformer.server.tiers import Capabilities, TierAssignment

if TYPE_CHECKING:
    from pathlib import Path

    from matformer.server.history import RunHistory
    from matformer.server.member_api import JoinAsk
    from matformer.server.membership import Membership
    from matformer.server.pipeline import RoundPipeline
    from matformer.server.policies.base import RoundPolicy
    from matformer.server.sections import AuthSection, FaultsSection

log = logging.getLogger("matformer.server")


def check_join(ask: JoinAsk, *, run_id: str, schema_hash: str, policy: RoundPolicy) -> None:
    """JoinRefused for a Join of another run or another model, or of a relay where the
    round ``policy`` must see each member's result."""
    if ask.run_id and ask.run_id != run_id:
        raise JoinRefused(f"this server runs {run_id!r}, not {ask.run_id!r}; check --server.")
    if ask.schema_hash is not None and ask.schema_hash != schema_hash:
        raise JoinRefused(f"the client's model has canonical schema hash "
                          f"{ask.schema_hash or '(none)'}, the run's model {schema_hash}; "
                          "load the run's checkpoint (--checkpoint server).")
    if ask.capabilities.relay and not policy.takes_partials:
        raise JoinRefused(f"this run's round policy, {policy.describe()}, must see each "
                          "member's result, which a relay's partial sum hides; join its "
                          "members directly, or run a policy that takes sums ([policy] name = "
                          "\"mean\", [update] vote = \"mean\").")


def credentials(auth: AuthSection, keys_path: Path, presented: str, *,
                relay: bool = False) -> KeyHolder | None:
    """Whose client key a Join presents (``[auth] mode = "keys"``), None under the other
    modes. WrongJoinToken for a token or key the run does not hold; RoleNotGranted for a
    relay presenting a member's credential or a member a relay's (the run's operator grants
    the role: [auth] relay_token, or ``keys add NAME --relay``); KeysUnreadable (the reason
    logged, not told) when the keys file cannot be read."""
    if auth.mode == "token":  # "none" admits anyone; the server is loopback-only then
        granted = auth.relay()
        as_relay = granted is not None and tokens_equal(presented, granted)
        if as_relay != relay and (as_relay or tokens_equal(presented, auth.token())):
            raise _role_refused(relay, "[auth] relay_token")
        if not as_relay and not tokens_equal(presented, auth.token()):
            raise WrongJoinToken("wrong join token; ask the run's operator for it "
                                 "(--join-token).")
        return None
    if auth.mode != "keys":
        return None
    try:
        holder = KeyFile(keys_path).holder(presented)
    except KeyFileError as err:
        log.error("%s", err)
        raise KeysUnreadable("the coordinator cannot read its client keys; tell the run's "
                             "operator.") from None
    if holder is None:
        raise WrongJoinToken("unknown client key; this run admits only clients with a key its "
                             "operator issued (matformer-server keys add NAME): pass it as "
                             "--join-token.")
    if holder.relay != relay:
        raise _role_refused(relay, "a key issued with `matformer-server keys add NAME --relay`")
    return holder


def _role_refused(relay: bool, grant: str) -> RoleNotGranted:
    if relay:
        return RoleNotGranted(f"this credential admits a member, not a relay: a relay speaks "
                              f"for its members, so the run's operator grants the role "
                              f"({grant}); ask them for it (matformer relay --relay-token).")
    return RoleNotGranted("this credential admits a relay, not a member; join with the run's "
                          "join token or your own client key (--join-token).")


class JoinGate:
    """How many members at once and how fast joins may come, for a root ([faults]) and for
    a relay's own members alike."""

    def __init__(self, faults: FaultsSection, now: float) -> None:
        self.faults = faults  # read at each join: an operator may change the limits
        self.bucket = (float(faults.max_joins_per_minute), now)  # (joins left, when filled)

    def admit(self, members: int, now: float) -> None:
        """RunFull when ``members`` (those the join would sit beside) already reach
        max_members, JoinsTooFast beyond max_joins_per_minute (a bucket of that many joins,
        refilled over a minute); nothing changes on a refusal."""
        most, per_minute = self.faults.max_members, self.faults.max_joins_per_minute
        if members >= most:
            raise RunFull(f"the run has {most} members, the most it admits ([faults] "
                          "max_members); try again when one has left.")
        rate = per_minute / 60
        level, at = self.bucket
        level = min(per_minute, level + (now - at) * rate)
        if level < 1:
            raise JoinsTooFast(f"more than {per_minute} joins in a minute ([faults] "
                               f"max_joins_per_minute); retry in {(1 - level) / rate:.0f} s.")
        self.bucket = (level - 1, now)


class Admissions:
    def __init__(self, membership: Membership, pipeline: RoundPipeline, history: RunHistory,
                 faults: FaultsSection, *, clock: Callable[[], float],
                 save: Callable[[], None], mark_unsaved: Callable[[], None]) -> None:
        """``save`` writes state.json at once (an exclusion), ``mark_unsaved`` says it
        changed in memory."""
        self.membership, self.pipeline, self.history = membership, pipeline, history
        self.faults, self.clock = faults, clock
        self.save, self.mark_unsaved = save, mark_unsaved
        self.gate = JoinGate(faults, clock())

    def drop_member(self, client_id: str, why: str) -> None:
        self.pipeline.drop_member(client_id, why)

    def join(self, capabilities: Capabilities, *, key: KeyHolder | None = None,
                 previous_session: str | None = None) -> tuple[Member, TierAssignment, str]:
        """Admit a client: its member record, tier assignment and session token.

        ``key`` (``[auth] mode = "keys"``) names the member, whatever name it reports.
        ``previous_session`` is the session token of the member this client was before (a
        restarted client presents it). A name belongs to one live member: a join under the name
        of a member heard from within ``heartbeat_timeout_s`` is refused (NameTaken) unless it
        proves to be that member, by its key or its previous session; the member it proves to
        be, or one gone silent, is replaced. A key or a previous session that was excluded is
        refused with the exclusion's reason."""
        now, membership = self.clock(), self.membership
        before = membership.sessions.client_of(previous_session) if previous_session else None
        if key is not None:
            capabilities = dataclasses.replace(capabilities, name=key.name)
            reason = membership.excluded_keys.get(key.key_hash)
            if reason is not None:
                raise Excluded(f"the key of {key.name!r} was excluded from the run: {reason}")
        if before in membership.excluded:
            raise Excluded(f"{before} was excluded from the run: {membership.excluded[before]}")
        holder = membership.named(capabilities.name)
        proven = holder is not None and (key is not None or before == holder.client_id)
        silent = now - holder.last_seen if holder is not None else 0.0
        if holder is not None and not proven and silent <= self.faults.heartbeat_timeout_s:
            raise NameTaken(
                f"a live member of this run is named {capabilities.name!r}; choose another "
                "--name (a restarted client proves its name with the session it saved in its "
                "--state-dir).")
        self.gate.admit(len(self.membership.members) - (holder is not None), now)
        # the tier first: a join the policy refuses (its capabilities, no tier that fits) must
        # leave the member it would replace in place
        tier = membership.policy.assign(capabilities, [
            m.tier for m in membership.members.values() if m is not holder])
        if holder is not None:
            self.remove(holder, f"replaced by a new join as {holder.name!r}" if proven
                   else f"silent for {silent:.0f} s; its name was taken by a new join")
        joined = membership.join(capabilities, now=now, key_hash=key.key_hash if key else "",
                                 tier=tier)
        member, tier, _ = joined
        self.history.event("join", member,
                        f"{member.name} ({member.device_kind}) at tier {tier.tier}: {tier.reason}")
        return joined


    def remove(self, member: Member, why: str, *, dropped: str | None = None) -> None:
        """Take a member out of the run (it left, or a new join replaced it): its session ends,
        its unsubmitted ids go back to the queue (``dropped``: the rounds' record of why, else
        ``why``)."""
        self.membership.leave(member.client_id)
        self.drop_member(member.client_id, dropped or why)
        self.history.departed(member, why)
        self.history.event("leave", member, why)


    def exclude(self, client_id: str, reason: str) -> None:
        """Remove a member for good (too many bad results, or an operator's decision): its
        unsubmitted ids go back to the queue, and its later calls are answered
        PERMISSION_DENIED with ``reason``. Raises UnknownClient for a non-member."""
        who = self.membership.members.get(client_id, client_id)
        self.membership.exclude(client_id, reason)
        self.drop_member(client_id, f"excluded: {reason}")
        self.history.event("exclude", who, reason)
        self.save()


    def expire_sessions(self, now: float) -> None:
        """End the session of every member silent for [faults] session_ttl_s: it must join
        again."""
        ttl = self.faults.session_ttl_s
        for member in [m for m in self.membership.members.values() if now - m.last_seen > ttl]:
            self.membership.leave(member.client_id)
            self.drop_member(member.client_id, "its session expired")
            self.history.departed(member, f"silent for {now - member.last_seen:.0f} s: its session "
                                       "expired")
            self.history.event(
                "expire", member,
                f"silent for {now - member.last_seen:.0f} s (session_ttl_s {ttl:g}): its session "
                "expired; it must join again")


    def count_refusal(self, client_id: str, error: Exception) -> str:
        """Count a refused submission against the member (a round stops waiting for it once the
        others are in); at [faults] max_rejections it is excluded. The words to add to the
        refusal's message ("" when nothing follows)."""
        if not getattr(error, "counted", True) or client_id not in self.membership.members:
            return ""
        assigned = self.pipeline.assignment_for(client_id)
        if assigned is not None:
            self.pipeline.refused[client_id] = assigned.assignment_id
        member = self.membership.get(client_id)
        member.rejections += 1
        limit = self.faults.max_rejections
        self.history.event("reject", member, f"refused submission {member.rejections}"
                        f"{f' of {limit}' if limit else ''}: {type(error).__name__}: "
                        f"{str(error)[:200]}")
        if limit and member.rejections >= limit:
            self.exclude(client_id, f"{member.rejections} submissions refused, the last: "
                                 f"{str(error)[:200]}")
            return (f" This was refusal {member.rejections} of {limit}: the client is excluded "
                    "from the run.")
        self.mark_unsaved()
        return f" (refusal {member.rejections} of {limit})" if limit else ""
