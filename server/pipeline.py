"""The rounds in flight (docs/architecture.md, "One round"): each is opened (its ids split
over the active members), collected, closed and committed, in order.

    pipeline = RoundPipeline(config, membership, history, queue, length)
    pipeline.open_rounds(now, first_index, room=True)   # as many as the window allows
    pipeline.drop_silent(now); pipeline.drop_refused()
    rnd = pipeline.ready(now)        # the oldest round, once complete or past its deadline
    pipeline.detach(rnd, now)        # ... handed to the close; settle() once it commits

Without overlap one round is collected at a time, and the next opens once it is committed.
With ``[round] overlap`` up to ``WINDOW`` rounds are collected at once and a new one opens as
soon as the oldest is detached for its close: a member then always holds its next
assignment when it finishes training one (the answer to its submission carries it), and
rounds close one at a time, in order, while the younger ones go on.

The member-side consequences of a round live here too: who missed it (its ids back to the
queue, or held for its late result under ``[round] late_rounds``; a smaller share, in the end
a smaller tier) and who finished early (a larger tier).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from matformer.server.config import RunConfig
from matformer.server.history import RunHistory
from matformer.server.late import LateWork
from matformer.server.membership import Member, Membership
from matformer.server.rounds import (
    OpenRound,
    RoundAssignment,
    Submission,
    deadline_after,
    pulled_in,
)
from matformer.server.work import WorkQueue, assign

# Rounds collected at once with overlap: the one whose results are arriving, the one being
# trained, and the one handed out with the answer to a submission.
WINDOW = 3
# The share of a round's deadline its work may fill at the speeds its members delivered
# earlier rounds at: the rest is margin for a slower round.
DEADLINE_SHARE = 0.5
# A member that has delivered no round yet is counted at this share of its probe's speed: the
# probe ran alone, and members often share a machine (a testnet, a busy laptop) once they
# train side by side.
PROBE_SHARE = 0.5


class RoundPipeline:
    def __init__(self, config: RunConfig, membership: Membership, history: RunHistory,
                 queue: WorkQueue, length: Callable[[int], int]) -> None:
        self.config = config
        self.membership = membership
        self.history = history
        self.queue = queue
        self.length = length  # sequence id → its tokens
        self.collecting: list[OpenRound] = []  # oldest first
        self.closing: OpenRound | None = None  # detached from collection, being closed
        # client id → the assignment its last counted refusal was for: once the others are
        # in, a round stops waiting for a member refused in it (drop_refused)
        self.refused: dict[str, str] = {}
        # client id → why: members to exclude for missing [faults] max_misses rounds in a
        # row; the coordinator's admissions exclude them (``take_exclusions``)
        self.excluding: dict[str, str] = {}
        # client id → the assignment whose submission is arriving (its header passed): a
        # member that missed its last round is still waited for while its upload comes in
        self.arriving: dict[str, str] = {}
        # client id → submissions it started (headers that arrived, late ones too), and that
        # count when its current run of misses began: kept in memory only, so a refusal
        # changes nothing the run saves
        self.attempts: dict[str, int] = {}
        self.attempts_at_miss: dict[str, int] = {}
        self.owed: dict[str, float] = {}  # client id → ids rounding left it short (assign)
        self.sized = False  # whether rounds are sized below tokens_per_round (round_tokens)
        # results that missed their round's deadline, while a later round may fold them in
        self.late = LateWork(config.round.late_rounds, config.round.late_weight)

    @property
    def window(self) -> int:
        return WINDOW if self.config.round.overlap else 1

    # -- what members hold ----------------------------------------------------------------

    def find(self, round_index: int) -> OpenRound | None:
        return next((r for r in self.collecting if r.index == round_index), None)

    def pending(self, client_id: str) -> list[RoundAssignment]:
        """The member's assignments not yet submitted, oldest first."""
        return [r.assignments[client_id] for r in self.collecting
                if client_id in r.assignments and client_id not in r.submissions]

    def assignment_for(self, client_id: str, after: int | None = None
                       ) -> RoundAssignment | None:
        """The member's oldest assignment not yet submitted (in a round after ``after``)."""
        return next((a for a in self.pending(client_id) if after is None or a.round > after),
                    None)

    def next_work_in(self, client_id: str, now: float, close_s: float,
                     close_started: float | None) -> float | None:
        """Seconds until ``client_id`` is likely to have work again, when it has none now:
        for a member that has submitted, until the slowest of the others submits (each as
        long after the opening as its last round took) plus a close as long as the last
        (``close_s``); during a close, what is left of it. None when nothing tells (a new
        member, a member without work this round, an estimate already overdue)."""
        rnd = self.collecting[0] if self.collecting else None
        if rnd is not None and client_id in rnd.submissions:
            pending = [self.membership.members.get(c) for c in rnd.pending()]
            if any(m is None or not m.last_round_seconds for m in pending):
                return None
            slowest = max((m.last_round_seconds for m in pending), default=0.0)
            left = rnd.opened_at + slowest + close_s - now
        elif self.closing is not None and close_started is not None:
            left = close_s - (now - close_started)
        else:
            return None
        return left if left > 0 else None

    def keep(self, rnd: OpenRound, assigned: RoundAssignment, submission: Submission, *,
             train_seconds: float | None, dense_bytes: int, missed: Sequence[int] = ()) -> None:
        """A submission the gate passed, kept in its round, and what it says of its member:
        bytes, compute time, and its speed (``train_seconds``, the member's own compute
        time; without it, or 0, the time since the round opened). A relay's ``assigned`` is
        what it delivered, and ``missed`` the rest, which goes back to the queue."""
        client_id = assigned.client_id
        if missed:  # a relay's members did not deliver these: its work is what they did
            rnd.assignments[client_id] = assigned
            self.queue.requeue(missed)
        rnd.submissions[client_id] = submission
        self._delivered(assigned, submission, rnd.opened_at, train_seconds=train_seconds,
                        dense_bytes=dense_bytes)

    def late_work(self, client_id: str, round_index: int, assignment_id: str | None, *,
                  now: float) -> RoundAssignment | None:
        """With late results on, the member's assignment in round ``round_index`` that its
        submission may still deliver late: held since the round closed without it, or still
        pending in the round being closed or in a collected one past its deadline. None
        otherwise (the gate's refusal stands)."""
        if not self.late.on:
            return None
        held = self.late.find(client_id, round_index, assignment_id)
        if held is not None:
            return held
        rounds = [self.closing] if self.closing is not None else []
        for rnd in [*rounds, *(r for r in self.collecting if now >= r.deadline)]:
            if rnd.index == round_index and client_id in rnd.pending():
                assigned = rnd.assignments[client_id]
                if assignment_id is None or assignment_id == assigned.assignment_id:
                    return assigned if assigned.assignment_id not in self.late.kept else None
        return None

    def keep_late(self, assigned: RoundAssignment, delivered: RoundAssignment,
                  submission: Submission, *, train_seconds: float | None, dense_bytes: int,
                  missed: Sequence[int] = ()) -> None:
        """A late result the gate passed, kept for the next round to close (``assigned``:
        the work it answers; ``delivered``: what a relay delivered of it, ``missed`` the
        rest, which goes back to the queue)."""
        self.late.keep(delivered, submission, assignment_id=assigned.assignment_id)
        self.attempted(assigned.client_id)  # it delivers: counted after its miss, if before
        if missed:
            self.queue.requeue(missed)
        opened_at = assigned.deadline - self.config.round.deadline_s  # about: its round's
        self._delivered(delivered, submission, opened_at, train_seconds=train_seconds,
                        dense_bytes=dense_bytes)

    def _delivered(self, assigned: RoundAssignment, submission: Submission, opened_at: float,
                   *, train_seconds: float | None, dense_bytes: int) -> None:
        """What a kept submission says of its member: bytes, compute time, speed."""
        client_id = assigned.client_id
        member = self.membership.get(client_id)
        member.bytes_up += submission.wire_bytes
        member.dense_bytes_up += dense_bytes
        member.compute_s += train_seconds or 0.0
        member.last_round_compute_s = train_seconds or 0.0
        measured = train_seconds if train_seconds else submission.received_at - opened_at
        self.membership.measured(client_id, assigned.tokens, measured)
        started = max(opened_at, member.last_delivered_at)  # overlapped: after the last
        if submission.received_at > started:
            member.delivered_per_second = assigned.tokens / (submission.received_at - started)
        member.last_delivered_at = submission.received_at

    # -- opening ----------------------------------------------------------------------------

    def open_rounds(self, now: float, first_index: int, *, room: bool,
                    last: int | None) -> bool:
        """Open rounds until the window is full: the first at ``first_index`` when none is in
        flight. Only with ``room`` to close them, enough active members, and never round
        ``last`` or beyond (None: no limit). Whether one opened."""
        opened = False
        while len(self.collecting) < self.window and room:
            if not self.config.round.overlap and self.closing is not None:
                break
            index = self.collecting[-1].index + 1 if self.collecting else first_index
            if last is not None and index >= last:
                break
            rnd = self._open(now, index)
            if rnd is None:
                break
            self.collecting.append(rnd)
            opened = True
        if opened and len(self.collecting) == 1:
            self.refused.clear()  # refusals of earlier assignments hold no round up
            self.arriving.clear()
        return opened

    def _open(self, now: float, index: int) -> OpenRound | None:
        cfg = self.config.round
        # ready: alive and with a speed to size a share by (a member still loading its
        # checkpoint has measured none yet, and would get no ids)
        members = [m for m in self.membership.active(
            now=now, timeout_s=self.config.faults.heartbeat_timeout_s) if m.tokens_per_second > 0]
        if len(members) < cfg.min_clients:
            return None
        before = self.queue.to_dict()
        speeds = trusted_speeds(members)
        ids = self.queue.take(self.round_tokens(index, members, speeds), self.length)
        shares = assign(ids, speeds, self.owed)
        deadline = deadline_after(now, [r.deadline for r in self.collecting], cfg.deadline_s)
        tiers = {m.client_id: m.tier for m in members}
        nonce = uuid.uuid4().hex[:12]  # a restarted coordinator's split of round r differs
        assignments = {
            client: RoundAssignment(round=index, client_id=client, tier=tiers[client],
                                    sequence_ids=tuple(int(i) for i in chosen),
                                    tokens=sum(self.length(int(i)) for i in chosen),
                                    deadline=deadline,
                                    assignment_id=f"{index}.{nonce}.{client}")
            for client, chosen in shares.items() if len(chosen)
        }
        return OpenRound(index=index, opened_at=now, deadline=deadline, assignments=assignments,
                         queue_before=before, names={m.client_id: m.name for m in members})

    def round_tokens(self, index: int, members: Sequence[Member],
                     speeds: Sequence[tuple[str, float]]) -> int:
        """Round ``index``'s token budget: tokens_per_round, or what ``members`` can deliver
        in DEADLINE_SHARE of the deadline when that is less, so that a round never asks more
        than its members can deliver in time. Each counts at the rate it delivered its last
        round at, or PROBE_SHARE of its trusted speed (``speeds``) before it has delivered
        one. Said when rounds start being sized so, with the setting to change, and when they
        stop."""
        cfg = self.config.round
        trusted = dict(speeds)
        rate = sum(m.delivered_per_second or trusted[m.client_id] * PROBE_SHARE
                   for m in members)
        fits = int(rate * cfg.deadline_s * DEADLINE_SHARE)
        sized = fits < cfg.tokens_per_round
        if sized != self.sized:
            self.sized = sized
            self.history.event("size", None, (
                f"round {index} asks {max(fits, 1):,} of tokens_per_round "
                f"{cfg.tokens_per_round:,} tokens: its {len(members)} member(s) deliver about "
                f"{rate:,.0f} tokens/s, {cfg.tokens_per_round / rate:,.0f} s for a full round "
                f"against deadline_s {cfg.deadline_s:g} (a round may take "
                f"{DEADLINE_SHARE:.0%} of it); raise [round] deadline_s to "
                f"{math.ceil(cfg.tokens_per_round / rate / DEADLINE_SHARE)} or lower "
                "tokens_per_round to fill rounds again") if sized else (
                f"round {index} asks the whole tokens_per_round "
                f"{cfg.tokens_per_round:,} again: its members deliver {rate:,.0f} tokens/s"))
        return max(1, min(fits, cfg.tokens_per_round))

    def step(self, now: float, *, committed: int, room: Callable[[], bool],
             last: int | None, detach: bool) -> tuple[OpenRound | None, bool]:
        """Open rounds while the window has room (the first after the ``committed`` ones and
        the one closing; ``room()``: the disk can take a close), drop the silent and the
        refused; with ``detach``, take the round to close now out of collection. A round
        nobody delivered ends without a close, and the rounds behind it too (their indices
        would skip it): their ids are requeued. The round to close, and whether a round
        ended so (state.json should say it)."""
        ended = False
        while True:
            if len(self.collecting) < self.window:
                self.open_rounds(now, committed + (self.closing is not None), room=room(),
                                 last=last)
            if not self.collecting:
                return None, ended
            self.drop_silent(now)
            self.drop_refused()
            rnd = self.ready(now)
            if rnd is None or not detach:
                return None, ended
            if rnd.submissions:
                self.detach(rnd, now)
                return rnd, ended
            self.collecting.remove(rnd)  # nobody delivered: round r opens again
            self.settle(rnd)
            self.cancel(f"round {rnd.index} ended with no results")
            ended = True

    # -- closing --------------------------------------------------------------------------

    def ready(self, now: float) -> OpenRound | None:
        """The oldest round being collected once it is complete or past its deadline, when
        no other round is closing: rounds close one at a time, in order."""
        if self.closing is not None or not self.collecting:
            return None
        rnd = self.collecting[0]
        return rnd if rnd.complete() or now >= rnd.deadline else None

    def detach(self, rnd: OpenRound, now: float) -> None:
        """Take ``rnd`` out of collection for its close. The round behind it got its deadline
        deadline_s after ``rnd``'s; its members are free for it from ``now``, so it ends no
        later than deadline_s from now. Otherwise rounds that end early would push every
        later deadline a further deadline_s out, and a member that goes quiet would hold a
        round up for minutes."""
        self.collecting.remove(rnd)
        self.closing = rnd
        folded, expired = self.late.take(rnd.index)
        rnd.late.extend(folded)
        self.late.requeue(expired, self.queue.requeue)
        for assignment in expired:
            self.history.event("drop", self.membership.members.get(
                assignment.client_id, assignment.client_id),
                f"its late result for round {assignment.round} did not come within "
                f"[round] late_rounds ({self.late.rounds}); its sequences are trained again")
        behind = self.collecting[0] if self.collecting else None
        if behind is not None:
            deadline = pulled_in(behind.deadline, now, self.config.round.deadline_s)
            if deadline < behind.deadline:
                behind.deadline = deadline
                behind.assignments = {c: dataclasses.replace(a, deadline=deadline)
                                      for c, a in behind.assignments.items()}

    def snapshot(self) -> tuple[list[tuple[OpenRound, dict[str, RoundAssignment],
                                           dict[str, str]]], Any]:
        """The round being closed and those being collected, each with its assignments and
        drops as they are, and the late work, to ``restore``: a close that cannot be saved
        gives them back."""
        rounds = [self.closing] if self.closing is not None else []
        return ([(r, dict(r.assignments), dict(r.dropped)) for r in [*rounds, *self.collecting]],
                self.late.snapshot())

    def restore(self, snapshot: tuple[list[tuple[OpenRound, dict[str, RoundAssignment],
                                                 dict[str, str]]], Any]) -> None:
        """As ``snapshot`` found them, the round that was being closed collected again."""
        rounds, late = snapshot
        for rnd, assignments, dropped in rounds:
            rnd.assignments, rnd.dropped = assignments, dropped
        self.closing = None
        self.collecting = [r for r, _, _ in rounds]
        self.late.restore(late)

    def reopen(self, rnd: OpenRound) -> None:
        """A close that failed: ``rnd`` is collected again (its results kept)."""
        self.closing = None
        self.collecting.insert(0, rnd)

    def cancel(self, why: str) -> None:
        """End every round being collected without closing it: their ids back to the queue
        (the youngest's first, so the oldest's come out first again)."""
        for rnd in reversed(self.collecting):
            for client in reversed(list(rnd.assignments)):
                self.queue.requeue(rnd.assignments.pop(client).sequence_ids)
                rnd.dropped[client] = why
            self.unfold(rnd)
        self.collecting.clear()

    def unfold(self, rnd: OpenRound) -> None:
        """A round that ends without its update: the late results folded into it are not
        trained either, so their ids go back to the front of the queue."""
        self.late.requeue([f.assignment for f in rnd.late], self.queue.requeue)
        rnd.late.clear()

    def saved_queue(self) -> dict[str, Any]:
        """The queue as state.json keeps it: a round not yet committed is not in the saved
        state, so its ids (the late results folded into them and the late work still held,
        then every round in flight's, oldest first) wait at the front."""
        rounds = ([self.closing] if self.closing else []) + self.collecting
        folded = [i for rnd in rounds for f in rnd.late for i in f.assignment.sequence_ids]
        held = folded + self.late.ids() + [i for rnd in rounds for a in rnd.assignments.values()
                                           if a.assignment_id not in self.late.kept
                                           for i in a.sequence_ids]
        return {"position": self.queue.position, "requeued": held + list(self.queue.requeued)}

    # -- members who fall behind --------------------------------------------------------

    def drop_silent(self, now: float) -> None:
        """Drop from every round being collected each assigned member silent for
        heartbeat_timeout_s (killed, hung, or starved of CPU): its ids go back to the queue
        now, not at the deadline, and the round closes as soon as the others are in. One
        silence is one miss, however many rounds it held work in (with overlap, up to
        WINDOW): a member that calls again was only slow, and is given work again."""
        timeout = self.config.faults.heartbeat_timeout_s
        held: dict[str, list[int]] = {}  # client → the rounds it is dropped from now
        gaps: dict[str, float] = {}
        for rnd in self.collecting:
            for client in rnd.pending():
                member = self.membership.members.get(client)
                gaps[client] = now - member.last_seen if member is not None else math.inf
                if gaps[client] > timeout:
                    self.queue.requeue(rnd.assignments.pop(client).sequence_ids)
                    rnd.dropped[client] = f"silent for {gaps[client]:.0f} s"
                    held.setdefault(client, []).append(rnd.index)
        for client, rounds in held.items():
            member = self.membership.members.get(client)
            if member is not None:
                if member.silence_counted == member.last_seen:
                    continue  # this silence was counted when it first cost a round
                member.silence_counted = member.last_seen
            self.missed(client, f"silent for {gaps[client]:.0f} s (heartbeat_timeout_s "
                                f"{timeout:g}) holding work of round"
                                f"{'s' if len(rounds) > 1 else ''} "
                                f"{', '.join(map(str, rounds))}: killed, hung, or starved of "
                                "CPU; its work goes to the others, and it is given work "
                                "again when it calls")

    def drop_refused(self) -> None:
        """Once every other member of the oldest round has delivered, stop waiting for those
        that showed they may not deliver: a member whose submission in it was refused (each
        refusal sends it to train its share again, so the round would wait for up to
        max_rejections trainings of a member that may never be accepted), and one that
        missed its last round and has handed nothing in since, not even late (it takes work
        and may deliver nothing; each such round is one more miss, and [faults] max_misses
        in a row exclude it; one whose upload is arriving, over a slow link, is waited for).
        Their ids go back to the queue; with late results on, a missing member's wait for
        its late result first (it may be slow rather than gone)."""
        if not self.collecting:
            return
        rnd = self.collecting[0]
        pending = rnd.pending()
        if not pending or not rnd.submissions:
            return
        ids = {c: rnd.assignments[c].assignment_id for c in pending}
        refused = {c for c in pending if self.refused.get(c) == ids[c]}
        missing = {c for c in pending if c not in refused and self._missing(c)
                   and self.arriving.get(c) != ids[c]}
        if refused | missing != set(pending):
            return
        for client in pending:
            assignment = rnd.assignments.pop(client)
            if client in missing and self.late.on:  # it may still deliver, late
                self.late.hold(assignment)
            else:
                self.queue.requeue(assignment.sequence_ids)
            if client in refused:
                rnd.dropped[client] = "its submission was refused"
                self.history.event("drop", self.membership.members.get(client, client),
                                   f"its submission for round {rnd.index} was "
                                   "refused; the round closes without it")
            else:
                rnd.dropped[client] = "missed its last round and was not waited for"
                self.missed(client, f"round {rnd.index} closed without it: it missed its "
                                    "last round, so the round does not wait for it once the "
                                    "others are in")

    def arrives(self, client_id: str, assignment_id: str) -> None:
        """A member's submission for ``assignment_id`` started to arrive (its header passed)."""
        self.arriving[client_id] = assignment_id

    def take_exclusions(self) -> dict[str, str]:
        """The members to exclude since the last call (client id → why)."""
        taken, self.excluding = self.excluding, {}
        return taken

    def _missing(self, client_id: str) -> bool:
        """Whether a member has shown it may not deliver: dropped from its last round, and
        no submission of it has arrived since, not even a late one."""
        member = self.membership.members.get(client_id)
        return member is not None and member.missed > 0 and self._idle(client_id)

    def _idle(self, client_id: str) -> bool:
        """No submission of the member arrived since its current run of misses began: it
        takes work and hands nothing in (a slow member's late submissions show it works)."""
        return self.attempts.get(client_id, 0) == self.attempts_at_miss.get(client_id, 0)

    def attempted(self, client_id: str) -> None:
        """A submission of the member started to arrive, in time or not."""
        self.attempts[client_id] = self.attempts.get(client_id, 0) + 1

    def drop_member(self, client_id: str, why: str) -> None:
        """Hand a member's unsubmitted ids of every round being collected back to the queue,
        and those of its late work not delivered (in front: the oldest)."""
        for rnd in reversed(self.collecting):
            if client_id not in rnd.submissions:
                dropped = rnd.assignments.pop(client_id, None)
                if dropped is not None:
                    self.queue.requeue(dropped.sequence_ids)
                    rnd.dropped[client_id] = why
        self.late.requeue(self.late.drop(client_id), self.queue.requeue)

    def settle(self, rnd: OpenRound) -> None:
        """The members' side of a round that ended: who missed it (their ids back to the
        queue, or held for a late result; a smaller share next time) and who was early."""
        deadline = self.config.round.deadline_s
        for client in rnd.pending():
            assignment = rnd.assignments.pop(client)
            late = ""
            if self.late.on:  # its result may still come: held, or already kept
                if assignment.assignment_id not in self.late.kept:
                    self.late.hold(assignment)
                late = (f"; its result may still be folded into the next "
                        f"{self.late.rounds} round(s)")
            else:
                self.queue.requeue(assignment.sequence_ids)
            rnd.dropped[client] = f"missed the deadline ({deadline:g} s){late}"
            self.missed(client, f"missed the round {rnd.index} deadline ({deadline:g} s){late}")
            if assignment.assignment_id in self.late.kept:
                self.attempted(client)  # its late result is in already: it works
        self._pace(rnd)

    def missed(self, client_id: str, why: str) -> None:
        """A member dropped from a round: a smaller share next time (its speed estimate is
        halved), after each [faults] miss_limit misses in a row the next smaller tier, and
        after max_misses in a row exclusion."""
        member = self.membership.members.get(client_id)
        self.history.event("drop", member or client_id, why)
        if member is None:
            return
        member.missed += 1
        if member.missed == 1:
            self.attempts_at_miss[client_id] = self.attempts.get(client_id, 0)
        member.early = 0
        member.tokens_per_second /= 2
        member.delivered_per_second /= 2
        faults = self.config.faults
        if faults.max_misses and member.missed >= faults.max_misses and self._idle(client_id):
            self.excluding[client_id] = (f"dropped from {member.missed} rounds in a row "
                                         f"([faults] max_misses): {why}")
        elif faults.miss_limit and member.missed % faults.miss_limit == 0:
            self._retier(member, +1, f"missed {member.missed} rounds in a row")

    def _pace(self, rnd: OpenRound) -> None:
        """Members that submitted: reset their misses; a member that keeps finishing within
        [faults] early_fraction of the deadline is offered the next larger tier."""
        faults = self.config.faults
        window = (rnd.deadline - rnd.opened_at) * faults.early_fraction
        for client, submission in rnd.submissions.items():
            member = self.membership.members.get(client)
            if member is None:
                continue
            member.missed = 0
            early = submission.received_at - rnd.opened_at <= window
            member.early = member.early + 1 if early else 0
            if faults.early_rounds and member.early >= faults.early_rounds:
                self._retier(member, -1, f"finished {member.early} rounds in a row within "
                                         f"{faults.early_fraction:.0%} of the deadline")

    def _retier(self, member: Member, step: int, why: str) -> None:
        """Move ``member`` one allowed tier smaller (step +1) or larger (step -1) when the
        tier policy allows; logged as an event with the reason. Never a relay: its members'
        tiers are the relay's to move."""
        if member.relay:
            return
        tier = self.membership.policy.moved(
            name=member.name, tier=member.tier, step=step, requested_tier=member.requested_tier,
            memory_bytes=member.memory_bytes,
            microbatch_tokens=member.microbatch_tokens or self.config.data.max_seq_len)
        if tier is None:
            if step < 0:
                member.early = 0  # no larger tier fits: count early rounds afresh
            return
        old = member.tier
        member.tier = tier
        member.early = 0  # misses count on: every miss_limit of them one tier smaller
        member.tier_reason = f"moved from tier {old} to tier {tier}: {why}"
        self.history.event("retier", member, member.tier_reason)


class Speeds(Protocol):
    """What a member's share is sized by: a root's member, or a relay's."""

    client_id: str
    tokens_per_second: float
    measured_by_round: bool  # the speed comes from a round it delivered
    missed: int  # rounds in a row it delivered nothing in


def trusted_speeds(members: Sequence[Speeds]) -> list[tuple[str, float]]:
    """The speed each member's share of a round is sized by. A speed the member has shown in
    a round it delivered counts as it is; a claimed one (a new member's, or one that missed
    its last round) counts up to a typical speed, so that claiming to be fast wins no more
    than a typical share until a round shows it. Typical: the lower median of the shown
    speeds, or of all when none is shown yet; the lower one, since the median of two is their
    mean, which a single claim of 1e9 drags up. No speed at all still gets a share."""
    speeds = [max(m.tokens_per_second, 1.0) for m in members]
    shown = [m.measured_by_round and not m.missed for m in members]
    known = [speed for speed, ok in zip(speeds, shown, strict=True) if ok] or speeds
    typical = statistics.median_low(known)
    return [(m.client_id, speed if ok else min(speed, typical))
            for m, speed, ok in zip(members, speeds, shown, strict=True)]
