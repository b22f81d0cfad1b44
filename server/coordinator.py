"""The coordinator's core: the run state machine (docs/architecture.md), driven by method
calls.

    coordinator = Coordinator(config, clock=time.time)  # resumes if config.run.dir has a run
    member, tier, token = coordinator.join(capabilities)
    coordinator.assignment_for(member.client_id)        # -> RoundAssignment | None
    coordinator.submit(member.client_id, round_index, results, loss=2.3)
    coordinator.advance()                               # closes a round past its deadline
    coordinator.updates_since(r); coordinator.latest_checkpoint()

Phases: ``waiting`` (fewer than ``min_clients`` active members) → ``collecting`` (round r
open: sequence ids split by measured tokens/s, lr from the schedule) → the round closes
when every assigned client submitted or the deadline passed → per parameter aggregate,
the broadcast's step, the new master, its hash per tier, the update logged, state.json
saved → the next round, until ``finished`` (N rounds or T tokens). Every K rounds a
checkpoint is written beside the next rounds (``server/checkpoints.py``) and listed once
whole. The run's history lives in ``server/history.py``, tier rules in ``server/tiers.py``.

Time comes only from ``clock``, so tests drive deadlines without sleeping. Every public
method holds one lock, briefly: a gRPC servicer may call them from its worker threads, and
a close does its heavy part without it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import re
import shutil
import statistics
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
from torch import Tensor

from modeling.checkpoint import load_pretrained
from modeling.compression import (
    DENSE_BYTES_PER_VALUE,
    Region,
    RoundUpdate,
    SparseResult,
    UpdateConfig,
    region_shape,
    tier_hashes,
    tier_regions,
    universal_shapes,
)
from modeling.mdat import Mdat
from modeling.models import build_model
from modeling.naming import canonical_state_dict
from modeling.tracking import NoTracker, Tracker, open_tracker
from modeling.training import target_tokens
from server.checkpoints import CheckpointRef, CheckpointStore
from server.config import RunConfig
from server.errors import (
    BadReport,
    Excluded,
    JoinsTooFast,
    NameTaken,
    ResumeError,
    RunDirectoryUnavailable,
    RunFull,
    SessionInvalid,
    StaleRound,
    UpdatesPruned,
    WrongTokenCount,
)
from server.history import RunHistory
from server.keys import KeyHolder
from server.ledger import TrainedLedger
from server.limits import SubmissionLimits, clip_to_peers
from server.membership import Member, Membership
from server.rounds import OpenRound, RoundAssignment, Submission
from server.state import RunState
from server.tiers import MAX_TOKENS_PER_SECOND, Capabilities, TierAssignment, check_speed
from server.update_log import UpdateLog
from server.update_steps import Carried, close_round
from server.work import WorkQueue, assign, work_order

SAVE_INTERVAL_S = 1.0  # joins, leaves and refusals reach state.json at most this often
MAX_LOSS = 1e4  # nats per token; a random model's loss is ln(vocab_size), about 10
# Free space a round needs before it opens, in multiples of the master's size: the update
# (at most the master's size), a checkpoint and its tier slices (under twice), state.json.
CLOSE_RESERVE = 3
# Names that atomic writes (modeling/atomic.py) give their temporary files and folders
# (".state.json.tmp-1a2b3c4d", ".round-4.old-1a2b3c4d"): what a kill during a write leaves.
TEMP_NAME = re.compile(r"\..+\.(tmp|old)(-[0-9a-f]{8})?")
# the round record's figures that go to the tracker, as round/<key>
TRACKED = ("duration_s", "slowest_s", "tokens", "clients", "bytes_sent", "bytes_dense")

log = logging.getLogger("matformer.server")
T = TypeVar("T")


class Coordinator:
    def __init__(self, config: RunConfig, *, clock: Callable[[], float] = time.time,
                 initial: Mapping[str, Tensor] | None = None) -> None:
        """Resume the run in ``config.run.dir``, or start it from ``initial`` (canonical
        names), else [model] checkpoint, else a model initialised with ``data.seed``."""
        self.config = config
        self.clock = clock
        self.dir = Path(config.run.dir)
        self.model_config = config.model.build()
        self.shapes = universal_shapes(self.model_config)
        self._regions: dict[int, dict[str, Region]] = {}
        self._lock = threading.RLock()
        self.history = RunHistory(lambda: self.state, clock)
        saved = RunState.load(self.dir)
        self.reader, order = work_order(Mdat.open(config.data.path), config, saved)
        self.log = UpdateLog(self.dir / "updates")
        self.checkpoints = CheckpointStore(self.dir / "checkpoints", self.model_config,
                                           config.tiers.allowed)
        self.ledger = TrainedLedger(self.dir)
        self._tracker: Tracker | None = None  # opened with the first round it records
        self.limits = SubmissionLimits(config.compression, config.faults)
        # What one round's steps carry to the next: the broadcast's error feedback (what
        # compressed steps left out) and the outer momentum, per canonical name. Not saved: a
        # restart begins both at zero (docs/architecture.md, "The update record").
        self.carried = Carried()
        self._close_s = self._close_started = 0.0  # the last close: seconds, start (clock)
        self._writing: int | None = None  # the checkpoint being written beside the rounds
        self._writer: threading.Thread | None = None
        self._writer_failed: BaseException | None = None
        self._open: OpenRound | None = None
        # client id → the assignment its last counted refusal was for: once the others are
        # in, the open round stops waiting for a member refused in it (_drop_refused)
        self._refused: dict[str, str] = {}
        self._closing: _Closing | None = None  # the round whose close is under way
        # called (lock held) after each round that moved the master, e.g. by tests and
        # benchmarks that watch rounds; a hook must be quick and must not call back in
        self.round_closed: list[Callable[[ClosedRound], None]] = []
        self._write_failure: str | None = None  # the last failed close's error, logged once
        self._waiting_for_disk = False  # a round waits for free space (said once)
        # Joins, leaves and refusals change state.json without a round: they are written
        # together by advance, so a burst of joins does not rewrite the file once each.
        self._unsaved, self._saved_at = False, -math.inf
        self._join_bucket = (float(config.faults.max_joins_per_minute), clock())  # (level, at)
        policy = config.tiers.build(self.model_config)
        if saved is None:
            self.state = RunState(run_id=config.run.id, data_fingerprint=self.reader.fingerprint,
                                  sequences=len(order))
            if len(order) < len(self.reader):
                self.history.event(
                    "data", None, f"left out {len(self.reader) - len(order):,} of "
                    f"{len(self.reader):,} sequences, of fewer than "
                    f"{target_tokens(self.model_config)} tokens: they carry no target")
            self.membership = Membership(policy)
            self.queue = WorkQueue(order)
            self._remove_temp_files()
            self._remove_unfinished_checkpoints()
            self.ledger.truncate(0)
            self.master = self._tied({n: t.detach().clone()
                                      for n, t in self._initial(initial).items()})
            self.checkpoints.write(0, self.master)
            self.state.checkpoints.append(0)
            self._save()
        else:
            self.state = saved
            if saved.data_fingerprint != self.reader.fingerprint:
                raise ResumeError(
                    f"{self.dir} was trained on data with fingerprint {saved.data_fingerprint}, "
                    f"but [data] now reads {self.reader.fingerprint}; point [data] at the run's "
                    "MDAT view, or start a new run directory.")
            if saved.sequences not in (None, len(order)):
                raise ResumeError(
                    f"{self.dir} hands out {saved.sequences} sequences, but [data] now gives "
                    f"{len(order)} that carry a target (the [model] changed?); restore the "
                    "run's run.toml, or start a new run directory.")
            self.membership = Membership.from_dict(policy, saved.membership)
            self.queue = WorkQueue(order, **saved.queue)
            self._remove_temp_files()
            self._remove_unfinished_checkpoints()
            self.ledger.truncate(saved.round)
            self.master = self._replayed()
            self.history.event("resume", None, f"resumed at round {saved.round}")

    # -- calls from clients -------------------------------------------------------------

    def join(self, capabilities: Capabilities, *, key: KeyHolder | None = None,
             previous_session: str | None = None) -> tuple[Member, TierAssignment, str]:
        """Admit a client: its member record, tier assignment and session token.

        ``key`` (``[auth] mode = "keys"``) names the member, whatever name it reports.
        ``previous_session`` is the session token of the member this client was before (a
        restarted client presents it). A name belongs to one live member: a join under the
        name of a member heard from within ``heartbeat_timeout_s`` is refused (NameTaken)
        unless it proves to be that member, by its key or its previous session; the member
        it proves to be, or one gone silent, is replaced. A key or a previous session that
        was excluded is refused with the exclusion's reason."""
        with self._lock:
            now = self.clock()
            before = (self.membership.sessions.client_of(previous_session)
                      if previous_session else None)
            if key is not None:
                capabilities = dataclasses.replace(capabilities, name=key.name)
                reason = self.membership.excluded_keys.get(key.key_hash)
                if reason is not None:
                    raise Excluded(f"the key of {key.name!r} was excluded from the run: "
                                   f"{reason}")
            if before in self.membership.excluded:
                raise Excluded(f"{before} was excluded from the run: "
                               f"{self.membership.excluded[before]}")
            holder = self.membership.named(capabilities.name)
            proven = holder is not None and (key is not None or before == holder.client_id)
            silent = now - holder.last_seen if holder is not None else 0.0
            if holder is not None and not proven and (
                    silent <= self.config.faults.heartbeat_timeout_s):
                raise NameTaken(
                    f"a live member of this run is named {capabilities.name!r}; choose "
                    "another --name (a restarted client proves its name with the session it "
                    "saved in its --state-dir).")
            self._admit_check(now, replacing=holder is not None)
            if holder is not None:
                self._remove(holder, f"replaced by a new join as {holder.name!r}"
                             if proven else f"silent for {silent:.0f} s; its name was taken "
                             "by a new join")
            joined = self.membership.join(capabilities, now=now,
                                          key_hash=key.key_hash if key else "")
            member, tier, _ = joined
            self.history.event(
                "join", member.client_id,
                f"{member.name} ({member.device_kind}) at tier {tier.tier}: {tier.reason}")
            self._unsaved = True  # written by advance, at most every SAVE_INTERVAL_S
            self.advance()
            return joined

    def _admit_check(self, now: float, *, replacing: bool) -> None:
        """RunFull beyond [faults] max_members (``replacing``: the join takes a member's
        place), JoinsTooFast beyond max_joins_per_minute (a bucket of that many joins,
        refilled over a minute). Checked before anything changes."""
        faults = self.config.faults
        if len(self.membership.members) - replacing >= faults.max_members:
            raise RunFull(f"the run has {faults.max_members} members, the most it admits "
                          "([faults] max_members); try again when one has left.")
        rate = faults.max_joins_per_minute / 60
        level, at = self._join_bucket
        level = min(faults.max_joins_per_minute, level + (now - at) * rate)
        if level < 1:
            raise JoinsTooFast(f"more than {faults.max_joins_per_minute} joins in a minute "
                               "([faults] max_joins_per_minute); retry in "
                               f"{(1 - level) / rate:.0f} s.")
        self._join_bucket = (level - 1, now)

    def _remove(self, member: Member, why: str, *, dropped: str | None = None) -> None:
        """Take a member out of the run (it left, or a new join replaced it): its session
        ends, its unsubmitted sequences go back to the queue (``dropped``: the round's record
        of why, else ``why``)."""
        self.membership.leave(member.client_id)
        self._drop_from_round(member.client_id, dropped or why)
        self.history.departed(member, why)
        self.history.event("leave", member.client_id, why)

    def heartbeat(self, client_id: str, *, tokens_per_second: float | None = None
                  ) -> RoundAssignment | None:
        """Mark the client alive (and take its measured speed, if it reports one); its
        assignment in the open round, if any."""
        if tokens_per_second is not None:
            check_speed(tokens_per_second, client_id)
        with self._lock:
            self.membership.heartbeat(client_id, now=self.clock())
            if tokens_per_second is not None:
                self.membership.reported(client_id, tokens_per_second)
        self.advance()  # without the lock: a close it starts holds nobody else up
        return self.assignment_for(client_id)

    def leave(self, client_id: str, reason: str = "") -> None:
        """Remove a member; its unsubmitted sequences of the open round go back to the queue."""
        with self._lock:
            self._remove(self.membership.get(client_id), reason or "left the run",
                         dropped="left the run")
            self._unsaved = True
            self.advance()

    def exclude(self, client_id: str, reason: str) -> None:
        """Remove a member for good (too many bad results, or an operator's decision): its
        unsubmitted sequences go back to the queue, and its later calls are answered
        PERMISSION_DENIED with ``reason``. Raises UnknownClient for a non-member."""
        with self._lock:
            self.membership.exclude(client_id, reason)
            self._drop_from_round(client_id, f"excluded: {reason}")
            self.history.event("exclude", client_id, reason)
            self._save()
            self.advance()

    def submit(self, client_id: str, round_index: int, results: Sequence[SparseResult], *,
               loss: float | None = None, train_seconds: float | None = None,
               assignment_id: str | None = None, wire_bytes: int = 0) -> None:
        """Take a client's results for the open round (all or none: a BadResult keeps none).
        ``train_seconds``, the client's own compute time, measures its speed; without it,
        the time since the round opened does (which also counts waiting and transfers).
        ``wire_bytes``: the submission's size as received, for the round's record."""
        with self._lock:
            self.membership.heartbeat(client_id, now=self.clock())
        self.advance()  # a round past its deadline closes before late results are looked at
        with self._lock:
            now = self.clock()
            if self._open is None or self.state.finished:
                raise StaleRound(f"no round is being collected (round {round_index} is over); "
                                 "wait for the next assignment.")
            rnd = self._open
            member = self.membership.get(client_id)
            assigned = rnd.assignments.get(client_id)
            tier = assigned.tier if assigned is not None else member.tier
            rnd.check(client_id, round_index, results, self.shapes, self.regions(tier),
                      assignment_id)
            tokens = rnd.assignments[client_id].tokens
            _check_reports(results, tokens, loss, train_seconds)
            results = self.limits.check(results)
            rnd.submissions[client_id] = Submission({r.name: r for r in results}, loss, now,
                                                    wire_bytes)
            member.bytes_up += wire_bytes
            member.dense_bytes_up += self.dense_bytes(tier)
            member.compute_s += train_seconds or 0.0
            member.last_round_compute_s = train_seconds or 0.0
            measured = (train_seconds if train_seconds is not None and train_seconds > 0
                        else now - rnd.opened_at)
            self.membership.measured(client_id, tokens, measured)
        self.advance()  # without the lock: the last submission closes the round

    def check_header(self, client_id: str, round_index: int,
                     assignment_id: str | None = None) -> RoundAssignment:
        """The assignment a submission's header names, checked as ``submit`` checks it first
        (the round is being collected, the client is assigned in it under ``assignment_id``
        and has not submitted), so that a stale or repeated submission is refused before any
        of its results is read."""
        with self._lock:
            self.advance()
            if self._open is None or self.state.finished:
                raise StaleRound(f"no round is being collected (round {round_index} is over); "
                                 "wait for the next assignment.")
            self._open.check(client_id, round_index, (), self.shapes, {}, assignment_id)
            return self._open.assignments[client_id]

    def rejected(self, client_id: str, error: Exception) -> str:
        """Count a refused submission against the client; at [faults] max_rejections it is
        excluded. The words to add to the refusal's message ("" when nothing follows)."""
        with self._lock:
            if not getattr(error, "counted", True) or client_id not in self.membership.members:
                return ""
            assigned = self.assignment_for(client_id)
            if assigned is not None:
                self._refused[client_id] = assigned.assignment_id
            member = self.membership.get(client_id)
            member.rejections += 1
            limit = self.config.faults.max_rejections
            self.history.event("reject", client_id, f"refused submission {member.rejections}"
                               f"{f' of {limit}' if limit else ''}: {type(error).__name__}: "
                               f"{str(error)[:200]}")
            if limit and member.rejections >= limit:
                self.exclude(client_id, f"{member.rejections} submissions refused, the last: "
                                        f"{str(error)[:200]}")
                return (f" This was refusal {member.rejections} of {limit}: the client is "
                        "excluded from the run.")
            self._unsaved = True
            consequence = f" (refusal {member.rejections} of {limit})" if limit else ""
        self.advance()  # without the lock: the round may have waited only for this member
        return consequence

    def authenticate(self, token: str) -> str:
        """The client id a session token belongs to. Raises Excluded for an excluded
        client's token, SessionInvalid for an unknown, revoked or expired one."""
        client_id = self.membership.sessions.client_of(token)
        if client_id is None:
            raise SessionInvalid("unknown, revoked or expired session token; call Join again.")
        with self._lock:
            if client_id in self.membership.excluded:
                raise Excluded(f"{client_id} was excluded from the run: "
                               f"{self.membership.excluded[client_id]}")
        return client_id

    def assignment_for(self, client_id: str) -> RoundAssignment | None:
        with self._lock:
            rnd = self._open
            return None if rnd is None else rnd.assignments.get(client_id)

    def next_work_in(self, client_id: str) -> float | None:
        """Seconds until ``client_id`` is likely to have work again, when it has none now:
        for a member that has submitted, until the slowest of the others submits (each as
        long after the opening as its last round took) plus a close as long as the last;
        during a close, what is left of it. None when nothing tells (a new member, a member
        without work this round, an estimate already overdue)."""
        with self._lock:
            now, rnd = self.clock(), self._open
            if self._closing is not None:
                left = self._close_s - (now - self._close_started)
            elif rnd is not None and client_id in rnd.submissions:
                pending = [self.membership.members.get(c) for c in rnd.assignments
                           if c not in rnd.submissions]
                if any(m is None or not m.last_round_seconds for m in pending):
                    return None
                slowest = max((m.last_round_seconds for m in pending), default=0.0)
                left = rnd.opened_at + slowest + self._close_s - now
            else:
                return None
            return left if left > 0 else None

    def logged_rounds(self, round_index: int) -> range:
        """Rounds ``round_index``, ..., the last completed one: those a client replays. Raises
        UpdatesPruned when the log no longer starts that early."""
        with self._lock:
            base = self._log_start()
            if round_index < base:
                latest = self.state.checkpoints[-1]
                raise UpdatesPruned(f"updates before round {base} are pruned; load checkpoint "
                                    f"round-{latest} (latest_checkpoint) and ask again.")
            return range(round_index, self.state.round)

    def updates_since(self, round_index: int) -> list[RoundUpdate]:
        """The logged updates of rounds ``round_index``, ..., the last completed one, read
        without the lock (a close prunes the log only after its checkpoint is listed)."""
        return [self.log.read(r) for r in self.logged_rounds(round_index)]

    def latest_checkpoint(self) -> CheckpointRef:
        """The latest listed checkpoint, where a joining client starts."""
        with self._lock:
            return self.checkpoints.ref(self.state.checkpoints[-1])

    # -- the state machine --------------------------------------------------------------

    @property
    def phase(self) -> str:
        if self.state.finished:
            return "finished"
        return "waiting" if self._open is None and self._closing is None else "collecting"

    @property
    def current_round(self) -> OpenRound | None:
        return self._open

    def advance(self) -> None:
        """Close the open round if complete or past its deadline; open the next if possible.

        A close's heavy part (aggregation, the new master, hashes, the update log, ledger and
        checkpoint writes) runs outside the lock, in the thread that found the round ready;
        meanwhile every other call is served (GetRound answers WAIT) and other threads'
        ``advance`` returns at once. Called without the lock held, as every frequent caller
        does, nothing heavy ever holds it."""
        while True:
            with self._lock:
                closing = self._next_close()
            if closing is None:
                return
            self._close(closing)

    def _next_close(self) -> _Closing | None:
        """(lock held) Expire sessions, open a round if none is open, drop the silent; the
        round to close now (detached: no longer open, not yet closed), or None."""
        now = self.clock()
        self._expire_sessions(now)
        closing = None
        while self._closing is None and not self.state.finished:
            if self._open is None:
                self._open = self._open_round(now)
                if self._open is None:
                    break
                self._refused.clear()  # refusals of earlier assignments hold no round up
            self._drop_silent(now)
            self._drop_refused()
            if not (self._open.complete() or now >= self._open.deadline):
                break
            rnd, self._open = self._open, None
            if any(c in rnd.submissions for c in rnd.assignments):
                closing = self._closing = _Closing.of(self, rnd)
                self._close_started = now
                break
            self._settle(rnd)  # nobody delivered: round r opens again with whoever is there
            self._save()
        if closing is None and self._unsaved and now - self._saved_at >= SAVE_INTERVAL_S:
            self._save()
        return closing

    def flush(self) -> None:
        """Finish the checkpoint being written, and write state.json now if joins, leaves or
        refusals changed it since the last write (``advance`` does so at most every
        SAVE_INTERVAL_S; a server stopping calls this)."""
        self._wait_for_checkpoint()
        with self._lock:
            if self._unsaved:
                self._save()

    def close(self) -> None:
        """``flush``, then close the tracker: a server stopping calls this."""
        self.flush()
        with self._lock:
            if self._tracker is not None:
                self._tracker.close()
                self._tracker = None

    def snapshot(self, *, since_round: int | None = 0, events_after: int | None = -1
                 ) -> dict[str, Any]:
        """One consistent copy of what the status API shows (server/api.py), taken under the
        lock that the gRPC threads change the run under: plain data, safe to read after.
        Loss points and round records from ``since_round`` on, events after seq
        ``events_after``; None leaves them out (records are never changed once written, so
        the copies are shallow)."""
        with self._lock:
            rnd = self._open
            opened = None if rnd is None else {
                "round": rnd.index, "opened_at": rnd.opened_at, "deadline": rnd.deadline,
                "assigned": sorted(rnd.assignments), "submitted": sorted(rnd.submissions),
                "tokens": sum(a.tokens for a in rnd.assignments.values())}
            return {
                "now": self.clock(), "run_id": self.config.run.id, "phase": self.phase,
                "round": self.state.round, "tokens": self.state.tokens,
                "rounds_planned": self.config.round.rounds,
                "tokens_planned": self.config.round.tokens,
                "min_clients": self.config.round.min_clients,
                "heartbeat_timeout_s": self.config.faults.heartbeat_timeout_s,
                "allowed_tiers": list(self.config.tiers.allowed),
                "checkpoints": list(self.state.checkpoints), "open_round": opened,
                "members": [dataclasses.asdict(m) for m in self.membership.members.values()],
                "excluded": [{"client_id": c, "reason": why,
                              "name": self.membership.excluded_names.get(c, "")}
                             for c, why in self.membership.excluded.items()],
                **self.history.since(round_index=since_round, events_after=events_after)}

    def downloaded(self, client_id: str, nbytes: int, *, rounds: int = 0) -> None:
        """Count what the service sent a member (``rounds``: round updates among it)."""
        with self._lock:
            member = self.membership.members.get(client_id)
            if member is not None:
                member.bytes_down += nbytes
                member.dense_bytes_down += rounds * self.dense_bytes(member.tier)

    def dense_bytes(self, tier: int) -> int:
        """float32 bytes of the weights a tier holds: a dense gradient's, or weights', size."""
        return DENSE_BYTES_PER_VALUE * sum(math.prod(region_shape(r))
                                           for r in self.regions(tier).values())

    def regions(self, tier: int) -> dict[str, Region]:
        """Canonical name → the region of the universal tensor that ``tier`` covers."""
        if tier not in self._regions:
            self._regions[tier] = tier_regions(self.shapes, self.model_config, tier)
        return self._regions[tier]

    def tier_hashes(self, tiers: Sequence[int], master: Mapping[str, Tensor] | None = None
                    ) -> dict[int, str]:
        """Weight hash of the master (or ``master``) at each tier: what a client of that tier
        must match."""
        master = self.master if master is None else master
        return tier_hashes(master, {t: self.regions(t) for t in sorted(set(tiers))})

    def _open_round(self, now: float) -> OpenRound | None:
        cfg = self.config.round
        members = self.membership.active(now=now, timeout_s=self.config.faults.heartbeat_timeout_s)
        if len(members) < cfg.min_clients or not self._room_to_close():
            return None
        r = self.state.round
        before = self.queue.to_dict()
        ids = self.queue.take(cfg.tokens_per_round, self._length)
        shares = assign(ids, _trusted_speeds(members))
        deadline = now + cfg.deadline_s
        tiers = {m.client_id: m.tier for m in members}
        nonce = uuid.uuid4().hex[:12]  # a restarted coordinator's split of round r differs
        assignments = {
            client: RoundAssignment(round=r, client_id=client, tier=tiers[client],
                                    sequence_ids=tuple(int(i) for i in chosen),
                                    tokens=sum(self._length(int(i)) for i in chosen),
                                    deadline=deadline,
                                    assignment_id=f"{r}.{nonce}.{client}")
            for client, chosen in shares.items() if len(chosen)
        }
        return OpenRound(index=r, opened_at=now, deadline=deadline, assignments=assignments,
                         queue_before=before, names={m.client_id: m.name for m in members})

    def _room_to_close(self) -> bool:
        """Whether the run directory has room for what closing a round writes (an update,
        a checkpoint with its slices, state.json); a round opens only then. Said once."""
        need = CLOSE_RESERVE * sum(t.numel() * t.element_size() for t in self.master.values())
        free = shutil.disk_usage(self.dir).free
        if free >= need:
            self._waiting_for_disk = False
            return True
        if not self._waiting_for_disk:
            self._waiting_for_disk = True
            why = (f"{free / 2**20:,.0f} MiB free in the run directory, {need / 2**20:,.0f} MiB "
                   "needed to close a round")
            log.error("no round opens: %s; free some space", why)
            self.history.event("disk", None, f"no round opens: {why}")
        return False

    def _close(self, closing: _Closing) -> None:
        """Close a detached round as a transaction: the new master is computed beside the
        current one and the update log, ledger and checkpoint written without the lock; then,
        under it, the round's records and state.json, and only then does the coordinator take
        the new master. If a write fails (disk full, I/O error), memory and disk are put back
        as they were before the close, the round is open again, and RunDirectoryUnavailable
        names the error; the next call tries again."""
        rnd = closing.rnd
        try:
            master = self._compute(closing)
        except Exception as err:
            with self._lock:
                self._undo_disk(closing)
                self._open, self._closing = rnd, None
                self._close_failed(rnd, err)
        with self._lock:
            before = _Before.take(self, rnd)
            try:
                self._commit(closing, master)
            except Exception as err:
                before.restore(self, rnd)
                self._undo_disk(closing)
                self._closing = None
                self._close_failed(rnd, err)
            self._closing = None
            self._write_failure = None
            self._close_s = self.clock() - self._close_started
            if master is not None:
                closed = ClosedRound(round=closing.round, before=self.master, after=master,
                                     tiers={a.tier for a in closing.delivered.values()},
                                     update=closing.logged)
                self.master, self.carried = master, closing.carried
                for hook in self.round_closed:
                    hook(closed)
                if closing.checkpoint and not closing.finishes:
                    self._writing = closing.round + 1
                    self._writer = threading.Thread(
                        target=self._write_checkpoint, args=(self._writing, master),
                        name=f"checkpoint-{self._writing}", daemon=True)
                    self._writer.start()
            self._retire_checkpoints()
            try:
                self.log.prune(through=self._log_start() - 1)
            except OSError as err:  # a later close prunes again
                log.warning("pruning %s failed: %s", self.log.directory, err)

    def _close_failed(self, rnd: OpenRound, err: Exception) -> NoReturn:
        """(lock held) Re-raise a failed close: an error writing the run directory becomes
        RunDirectoryUnavailable (said once per distinct error), anything else as it is."""
        cause = err.__cause__ if isinstance(err, RunDirectoryUnavailable) else err
        if not isinstance(cause, OSError):
            raise err
        why = f"{type(cause).__name__}: {cause.strerror or cause}"
        if why != self._write_failure:
            self._write_failure = why
            log.error("round %d could not be written to %s (%s); it stays open and closes "
                      "once the run directory can be written", rnd.index, self.dir, why)
            self.history.event("disk", None, f"round {rnd.index} could not be saved ({why}); "
                               "it closes once the run directory can be written")
        raise RunDirectoryUnavailable(
            f"the coordinator cannot write its run directory ({why}); round {rnd.index} "
            "closes once it can. Retry shortly.") from err

    def _undo_disk(self, closing: _Closing) -> None:
        """(lock held) Remove what a failed close wrote: its logged update, ledger line and
        checkpoint (none of which needs free space)."""
        try:
            self.log.discard(closing.round)
            self.ledger.rewind(closing.ledger_bytes)
            self._remove_unfinished_checkpoints()
        except OSError as err:  # a restart repairs the disk side from state.json
            log.warning("undoing round %d on disk failed: %s", closing.round, err)

    def _retire_checkpoints(self) -> None:
        """Keep the newest [checkpoint] keep_last checkpoints (at least the latest, which a
        resume needs, and the one before it, where the update log starts and which a client
        that began loading it may still be reading), and the first with keep_first.
        state.json stops listing the others first, then their folders go: a crash in between
        leaves folders no state lists, which the next start removes. A failed save keeps them
        all until the next close."""
        policy = self.config.checkpoint
        listed = self.state.checkpoints
        first = 1 if policy.keep_first else 0  # the run's starting weights, for comparisons
        retired = listed[first:-policy.keep_last]
        if not retired:
            return
        self.state.checkpoints = listed[:first] + listed[-policy.keep_last:]
        try:
            self._save()
        except RunDirectoryUnavailable as err:
            self.state.checkpoints = listed
            log.warning("keeping checkpoints %s for now: %s", retired, err)
            return
        self._keep_checkpoints(why="retired (keep_last)")

    def _settle(self, rnd: OpenRound) -> None:
        """(lock held) The members' side of a round that ended: who missed it (their
        sequences back to the queue, a smaller share next time) and who was early."""
        for client in [c for c in rnd.assignments if c not in rnd.submissions]:
            self.queue.requeue(rnd.assignments.pop(client).sequence_ids)
            rnd.dropped[client] = f"missed the deadline ({self.config.round.deadline_s:g} s)"
            self._missed(client, f"missed the round {rnd.index} deadline "
                                 f"({self.config.round.deadline_s:g} s)")
        self._pace(rnd)

    def _compute(self, closing: _Closing) -> dict[str, Tensor] | None:
        """(no lock) The new master, with the update logged, the ledger line and any
        checkpoint written; None when the update would make a weight not finite (nothing is
        written then). Reads only what no other thread changes while a round closes."""
        by_name = closing.by_name
        clip = self.config.faults.peer_clip
        by_name = {name: clip_to_peers(results, clip) for name, results in by_name.items()}
        votes = self.config.update.vote == "majority"
        master, steps, carried = close_round(closing.update.build(), self.master, by_name,
                                             self.carried, votes=votes,
                                             momentum=self.config.update.momentum_of())
        master = self._tied(master)
        closing.broken = [n for n, t in master.items() if not bool(torch.isfinite(t).all())]
        if closing.broken:  # the limits on results make this unreachable; never serve it
            return None
        closing.carried = carried
        r = closing.round
        closing.logged = RoundUpdate(
            round=r, update=closing.update, steps=steps,
            hashes=self.tier_hashes(sorted(closing.tiers), master),
            coverage_tokens={n: sum(x.tokens for x in rs) for n, rs in by_name.items()})
        self.log.append(closing.logged)
        self.ledger.record(r, [i for a in closing.delivered.values() for i in a.sequence_ids])
        if closing.checkpoint:
            self._wait_for_checkpoint()  # one write at a time; also before the last one
            if closing.finishes:  # the run's last weights are listed before it is finished
                self.checkpoints.write(r + 1, master)
        return master

    def _commit(self, closing: _Closing, master: dict[str, Tensor] | None) -> None:
        """(lock held) The closed round in memory and state.json: the members' side, its
        records, the round counter and tokens, any checkpoint; or, for an update that would
        make a weight not finite, the round discarded and its sequences requeued."""
        rnd, r = closing.rnd, closing.round
        self._settle(rnd)
        if master is None:
            for client in list(rnd.assignments):
                self.queue.requeue(rnd.assignments.pop(client).sequence_ids)
            broken = closing.broken
            self.history.event(
                "discard", None, f"round {r} discarded: its update makes {broken[0]} (and "
                f"{len(broken) - 1} more) not finite; its sequences are requeued")
            self._save()
            return
        self._record_round(rnd, closing.by_name)
        self.state.round = r + 1
        self.state.tokens = closing.tokens_after
        self.state.finished = closing.finishes
        if closing.checkpoint and closing.finishes:
            self.state.checkpoints.append(r + 1)
            self.history.event("checkpoint", None, f"checkpoints/round-{r + 1}")
        self._save()

    def _write_checkpoint(self, round_index: int, master: Mapping[str, Tensor]) -> None:
        """(a thread of its own, started once a round is committed) Write the checkpoint of
        ``round_index`` while the next rounds go on, then list it in state.json, retire the
        old ones and prune the log. One that cannot be written is said and left out: the
        log keeps the rounds since the last listed checkpoint, and the next one tries again.
        Anything else (a kill) leaves a staging folder the next start removes."""
        try:
            self.checkpoints.write(round_index, master)
        except OSError as err:
            with self._lock:
                why = f"{type(err).__name__}: {err.strerror or err}"
                log.error("checkpoint round-%d could not be written: %s", round_index, why)
                self.history.event("disk", None, f"checkpoint round-{round_index} could not "
                                   f"be written ({why}); the next checkpoint tries again")
                self._writing = None
                self._keep_checkpoints(why="a checkpoint that could not be written")
            return
        except BaseException as err:  # a crash (kill -9 in tests): flush re-raises it
            self._writer_failed = err
            return
        with self._lock:
            self._writing = None
            self.state.checkpoints.append(round_index)
            try:
                self._save()
            except RunDirectoryUnavailable as err:
                self.state.checkpoints.remove(round_index)
                log.warning("checkpoint round-%d is written but not listed: %s", round_index,
                            err)
                return
            self.history.event("checkpoint", None, f"checkpoints/round-{round_index}")
            self._unsaved = True  # the event reaches state.json with the next save or flush
            self._retire_checkpoints()
            try:
                self.log.prune(through=self._log_start() - 1)
            except OSError as err:  # a later close prunes again
                log.warning("pruning %s failed: %s", self.log.directory, err)

    def _wait_for_checkpoint(self) -> None:
        """(no lock) Until the checkpoint being written, if any, is done; re-raise what
        killed its writer."""
        writer = self._writer
        if writer is not None:
            writer.join()
        failed, self._writer_failed = self._writer_failed, None
        if failed is not None:
            raise failed

    def _keep_checkpoints(self, *, why: str, level: int = logging.INFO) -> None:
        """(lock held) Remove the checkpoint folders state.json does not list, but the one
        being written."""
        keep = {*self.state.checkpoints, *([self._writing] if self._writing is not None
                                            else [])}
        self.checkpoints.keep_only(keep, why=why, level=level)

    def _drop_silent(self, now: float) -> None:
        """Drop from the open round every assigned client silent for heartbeat_timeout_s
        (killed, hung, or asleep): its sequences go back to the queue now, not at the
        deadline, and the round closes as soon as the others are in."""
        rnd = self._open
        timeout = self.config.faults.heartbeat_timeout_s
        for client in [c for c in rnd.assignments if c not in rnd.submissions]:
            member = self.membership.members.get(client)
            silent = now - member.last_seen if member is not None else math.inf
            if silent > timeout:
                self.queue.requeue(rnd.assignments.pop(client).sequence_ids)
                rnd.dropped[client] = f"silent for {silent:.0f} s"
                self._missed(client, f"silent for {silent:.0f} s during round {rnd.index} "
                                     f"(heartbeat_timeout_s {timeout:g}): killed or hung")

    def _drop_refused(self) -> None:
        """Once every other member of the open round has delivered, stop waiting for those
        whose submission in it was refused: each refusal sends such a member to train its
        share again, so the round would wait for up to max_rejections trainings of a member
        that may never be accepted. Their sequences go back to the queue."""
        rnd = self._open
        pending = [c for c in rnd.assignments if c not in rnd.submissions]
        if not pending or not rnd.submissions or any(
                self._refused.get(c) != rnd.assignments[c].assignment_id for c in pending):
            return
        for client in pending:
            self.queue.requeue(rnd.assignments.pop(client).sequence_ids)
            rnd.dropped[client] = "its submission was refused"
            self.history.event("drop", client, f"its submission for round {rnd.index} was "
                               "refused; the round closes without it")

    def _expire_sessions(self, now: float) -> None:
        ttl = self.config.faults.session_ttl_s
        for member in [m for m in self.membership.members.values() if now - m.last_seen > ttl]:
            self.membership.leave(member.client_id)
            self._drop_from_round(member.client_id, "its session expired")
            self.history.departed(member, f"silent for {now - member.last_seen:.0f} s: its session "
                                        "expired")
            self.history.event(
                "expire", member.client_id,
                f"silent for {now - member.last_seen:.0f} s (session_ttl_s {ttl:g}): "
                "its session expired; it must join again")

    def _missed(self, client_id: str, why: str) -> None:
        """A client dropped from a round: a smaller share next time (its speed estimate is
        halved) and, after [faults] miss_limit misses in a row, the next smaller tier."""
        self.history.event("drop", client_id, why)
        member = self.membership.members.get(client_id)
        if member is None:
            return
        member.missed += 1
        member.early = 0
        member.tokens_per_second /= 2
        limit = self.config.faults.miss_limit
        if limit and member.missed >= limit:
            self._retier(member, +1, f"missed {member.missed} rounds in a row")

    def _pace(self, rnd: OpenRound) -> None:
        """Clients that submitted: reset their misses; a client that keeps finishing within
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
        tier policy allows; logged as an event with the reason."""
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
        member.missed = member.early = 0
        member.tier_reason = f"moved from tier {old} to tier {tier}: {why}"
        self.history.event("retier", member.client_id, member.tier_reason)

    def _drop_from_round(self, client_id: str, why: str) -> None:
        """Hand a client's unsubmitted sequences of the open round back to the queue."""
        if self._open is not None and client_id not in self._open.submissions:
            dropped = self._open.assignments.pop(client_id, None)
            if dropped is not None:
                self.queue.requeue(dropped.sequence_ids)
                self._open.dropped[client_id] = why

    def _record_round(self, rnd: OpenRound, by_name: Mapping[str, Sequence[SparseResult]]
                      ) -> None:
        """The completed round in the run's history, and each member's share of it."""
        tokens = sum(a.tokens for a in rnd.assignments.values())
        for client, submission in rnd.submissions.items():
            member = self.membership.members.get(client)
            if member is not None:
                member.last_round = rnd.index
                member.last_round_tokens = rnd.assignments[client].tokens
                member.last_round_share = member.last_round_tokens / tokens if tokens else 0.0
                member.last_round_seconds = submission.received_at - rnd.opened_at
        self.history.loss(rnd)
        self.history.round(rnd, by_name)
        self._track(rnd.index)

    def _track(self, round_index: int) -> None:
        """(lock held) The round's record and losses to the run's tracker ([tracking]). A
        tracker that fails is said once and dropped: the rounds go on without it."""
        record = self.state.rounds[-1]
        scalars = {f"round/{key}": float(record[key]) for key in TRACKED}
        scalars |= {f"loss/tier_{tier}": points[-1][1] for tier, points in self.state.loss.items()
                    if points and points[-1][0] == round_index}
        try:
            if self._tracker is None:
                tracking = self.config.tracking
                self._tracker = open_tracker(tracking.kind, self.dir / "tensorboard",
                                             project=tracking.project,
                                             name=self.config.run.id,
                                             config={"run": self.config.run.id})
            self._tracker.log(round_index + 1, scalars)
            self._tracker.flush()
        except Exception as err:
            log.warning("[tracking] %s failed (%s); going on without it",
                        self.config.tracking.kind, err)
            self._tracker = NoTracker()

    # -- persistence --------------------------------------------------------------------

    def _save(self) -> None:
        """state.json as of the last completed round (an open round is not in it)."""
        self.state.queue = (self._open.queue_before if self._open is not None
                            else self.queue.to_dict())
        self.state.membership = self.membership.to_dict()
        try:
            self.state.save(self.dir)
            self._unsaved, self._saved_at = False, self.clock()
        except OSError as err:
            raise RunDirectoryUnavailable(
                f"the coordinator cannot write {self.dir.name}/state.json "
                f"({type(err).__name__}: {err.strerror or err}); retry shortly.") from err

    def _log_start(self) -> int:
        """The first round the update log keeps: that of the checkpoint before the latest,
        so a client that was one round behind when a checkpoint was written still catches
        up from the log instead of downloading the new checkpoint."""
        return self.state.checkpoints[-2 if len(self.state.checkpoints) > 1 else -1]

    def _remove_temp_files(self) -> None:
        """The temporary files and folders of atomic writes that a kill interrupted."""
        for path in sorted(self.dir.rglob(".*"), key=lambda p: len(p.parts), reverse=True):
            if TEMP_NAME.fullmatch(path.name) and path.exists():
                log.warning("removing %s: left by a write interrupted before a restart", path)
                shutil.rmtree(path) if path.is_dir() else path.unlink()

    def _remove_unfinished_checkpoints(self) -> None:
        """Staging folders and checkpoint folders that state.json does not list: what a crash
        in the middle of writing one (or before state.json recorded it, or after it stopped
        listing a retired one) left behind."""
        self._keep_checkpoints(level=logging.WARNING,
                               why="an unfinished or retired checkpoint from before a restart")

    def _initial(self, initial: Mapping[str, Tensor] | None) -> Mapping[str, Tensor]:
        if initial is not None:
            return initial
        if self.config.model.checkpoint is not None:
            model = self.config.model
            return canonical_state_dict(load_pretrained(
                model.checkpoint, trust_remote_code=model.trust_remote_code))
        torch.manual_seed(self.config.data.seed)
        return canonical_state_dict(build_model(self.model_config))

    def _replayed(self) -> dict[str, Tensor]:
        """The master of the saved state: latest checkpoint, then the logged updates since."""
        base = self.state.checkpoints[-1]
        try:
            master = self.checkpoints.read(base)
        except FileNotFoundError as err:
            raise ResumeError(f"state.json names checkpoint {err}, which is missing; "
                              "restore it, or start a new run directory.") from None
        entries = [self.log.read(r) for r in range(base, self.state.round)]
        for entry in entries:
            master = self._tied(entry.apply(master))
        self.master = master
        if entries and self.tier_hashes(list(entries[-1].hashes)) != entries[-1].hashes:
            raise ResumeError(f"replaying {self.dir / 'updates'} onto checkpoint round-{base} "
                              "does not reproduce the logged weight hashes; the log or the "
                              "checkpoint was altered. Restore them, or start a new run.")
        return master

    def _tied(self, master: dict[str, Tensor]) -> dict[str, Tensor]:
        """With tied embeddings the head is the embedding: clients update it under
        ``model.embed_tokens.weight`` only, so the master's ``lm_head.weight`` follows it."""
        if self.model_config.tie_word_embeddings:
            master["lm_head.weight"] = master["model.embed_tokens.weight"]
        return master

    def _length(self, sequence_id: int) -> int:
        return len(self.reader[sequence_id])


@dataclass(frozen=True, kw_only=True, slots=True)
class ClosedRound:
    """What ``Coordinator.round_closed`` hooks are told of a round that moved the master."""

    round: int
    tiers: set[int]  # the tiers of the clients whose results it aggregated
    before: Mapping[str, Tensor]  # the master before (canonical names; never changed after)
    after: Mapping[str, Tensor]  # ... and after the round
    update: RoundUpdate  # what the update log holds of the round


@dataclass(kw_only=True, slots=True)
class _Closing:
    """A round taken out of collection to be closed: what its close reads, fixed under the
    lock when it was detached, so the heavy part can run without it."""

    rnd: OpenRound
    round: int
    delivered: dict[str, RoundAssignment]  # the submitters' assignments, in assignment order
    by_name: dict[str, list[SparseResult]]  # canonical name → results, in that order
    update: UpdateConfig
    tiers: set[int]  # whose hashes the log records: every allowed tier and every trained one
    tokens_after: int  # the run's tokens once this round counts
    finishes: bool  # the run ends with this round
    checkpoint: bool  # a checkpoint follows this round
    ledger_bytes: int  # the ledger's size before this round's line
    broken: list[str] = field(default_factory=list)  # parameters the update would break
    logged: RoundUpdate | None = None  # what _compute logged
    carried: Carried = field(default_factory=Carried)  # residual and momentum after it

    @classmethod
    def of(cls, c: Coordinator, rnd: OpenRound) -> _Closing:
        r = c.state.round
        delivered = {client: a for client, a in rnd.assignments.items()
                     if client in rnd.submissions}
        by_name: dict[str, list[SparseResult]] = {}
        for client in delivered:  # assignment order: aggregation order is deterministic
            for name, result in rnd.submissions[client].results.items():
                by_name.setdefault(name, []).append(result)
        tokens_after = c.state.tokens + sum(a.tokens for a in delivered.values())
        stop = c.config.round
        finishes = (stop.rounds is not None and r + 1 >= stop.rounds) or (
            stop.tokens is not None and tokens_after >= stop.tokens)
        return cls(rnd=rnd, round=r, delivered=delivered, by_name=by_name,
                   update=c.config.update.build(r, stop.planned_rounds, c.config.compression),
                   tiers=set(c.config.tiers.allowed) | {a.tier for a in delivered.values()},
                   tokens_after=tokens_after, finishes=finishes,
                   checkpoint=finishes or (r + 1) % c.config.checkpoint.every_rounds == 0,
                   ledger_bytes=c.ledger.size())


@dataclass(slots=True)
class _Before:
    """What committing a close changes in memory, as it was: restored when state.json cannot
    be written. Record lists are copied shallowly (records are never changed once written)."""

    state: RunState
    queue: dict[str, Any]
    members: dict[str, Member]
    assignments: dict[str, RoundAssignment]
    dropped: dict[str, str]

    @classmethod
    def take(cls, c: Coordinator, rnd: OpenRound) -> _Before:
        s = c.state
        state = dataclasses.replace(
            s, loss={k: list(v) for k, v in s.loss.items()}, rounds=list(s.rounds),
            events=list(s.events), checkpoints=list(s.checkpoints), departed=list(s.departed))
        return cls(state=state, queue=c.queue.to_dict(),
                   members=copy.deepcopy(c.membership.members),
                   assignments=dict(rnd.assignments), dropped=dict(rnd.dropped))

    def restore(self, c: Coordinator, rnd: OpenRound) -> None:
        """Memory as before the commit, the round open again."""
        c.state = self.state
        c.queue = WorkQueue(c.queue.order, **self.queue)
        c.membership.members = self.members
        rnd.assignments, rnd.dropped = self.assignments, self.dropped
        c._open = rnd


def _trusted_speeds(members: Sequence[Member]) -> list[tuple[str, float]]:
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


def _check_reports(results: Sequence[SparseResult], tokens: int, loss: float | None,
                   train_seconds: float | None) -> None:
    """BadResult unless what a client says of its work is the coordinator's own count or
    physically possible: a result is weighted by the tokens assigned (a claimed count could
    steer the whole update), and speed and loss feed the next round's split and the record."""
    wrong = [r for r in results if r.tokens != tokens]
    if wrong:
        raise WrongTokenCount(
            f"{wrong[0].name} claims {wrong[0].tokens} tokens ({len(wrong)} result(s) differ), "
            f"but the assignment holds {tokens}; results are weighted by the tokens assigned, "
            "so send that count.")
    if loss is not None and not (math.isfinite(loss) and 0.0 <= loss <= MAX_LOSS):
        raise BadReport(f"the reported loss {loss} is not in 0..{MAX_LOSS:g}; the client "
                        "diverged, so it should reload the checkpoint.")
    if train_seconds is not None and (
            not math.isfinite(train_seconds) or train_seconds < 0
            or (train_seconds > 0 and tokens / train_seconds > MAX_TOKENS_PER_SECOND)):
        raise BadReport(f"train_seconds {train_seconds} for {tokens} tokens is not a time a "
                        f"machine can take (at most {MAX_TOKENS_PER_SECOND:g} tokens/s); "
                        "report the seconds the training took.")
