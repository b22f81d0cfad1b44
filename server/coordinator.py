"""The coordinator: the run's state machine over named parts (docs/architecture.md, "The
coordinator"), driven by method calls.

    coordinator = Coordinator(config, clock=time.time)  # resumes if config.run.dir has a run
    member, tier, token = coordinator.join(capabilities)
    coordinator.assignment_for(member.client_id)        # -> RoundAssignment | None
    coordinator.submit(member.client_id, round_index, results, loss=2.3)
    coordinator.advance()                               # closes a round past its deadline
    coordinator.updates_since(r); coordinator.latest_checkpoint()

The parts: membership and sessions (``server/membership.py``, ``server/joins.py``), the
submission gate (``server/gate.py``), the rounds in flight (``server/pipeline.py``: open →
collecting → closing → committed), the close transaction (``server/close.py``), the
checkpoint writer (``server/checkpoint_writer.py``), the start or resume
(``server/resume.py``) and the status snapshot (``server/status.py``). Phases: ``waiting``
(fewer than ``min_clients`` active members) → ``collecting`` (rounds in flight) →
``finished`` (N rounds or T tokens).

Time comes only from ``clock``, so tests drive deadlines without sleeping. Every public
method holds one lock, briefly: a gRPC servicer calls them from its worker threads. A close
runs without the lock: in the calling thread by default (tests step rounds so), or, for a
server, on the close worker (``run_closes``), so that no member's call ever waits for one.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from google.protobuf.message import Message
from torch import Tensor

from matformer.modeling.checkpoint.schema import canonical_schema_hash
from matformer.modeling.compression import (
    DENSE_BYTES_PER_VALUE,
    Region,
    RoundUpdate,
    SparseResult,
    region_shape,
    tier_regions,
    universal_shapes,
)
from matformer.modeling.mdat import Mdat
from matformer.protocol.records import ServedCheckpoint, SubmitHeader
from matformer.protocol.settings import RunSettings
from matformer.protocol.sparse import ResultLayouts
from matformer.server import resume, status
from matformer.server.catch_up import CatchUp
from matformer.server.checkpoint_writer import CheckpointWriter
from matformer.server.checkpoints import CheckpointRef, CheckpointStore
from matformer.server.close import ClosedRound, CloseWorker, Closing, RoundClose
from matformer.server.config import RunConfig
from matformer.server.errors import (
    BadCapabilities,
    BadReport,
    Excluded,
    MissedNotAssigned,
    RunDirectoryUnavailable,
    SessionInvalid,
    UnknownClient,
    UpdatesPruned,
)
from matformer.server.gate import SubmissionGate, check_fetch, check_relayed, check_tier_losses
from matformer.server.heartbeats import Beat
from matformer.server.history import RunHistory
from matformer.server.joins import Admissions, check_join, credentials
from matformer.server.keys import KeyHolder
from matformer.server.ledger import TrainedLedger
from matformer.server.limits import SubmissionLimits
from matformer.server.member_api import Expected, JoinAsk, Joined, Waiting
from matformer.server.membership import Member
from matformer.server.pipeline import RoundPipeline
from matformer.server.rounds import OpenRound, RoundAssignment, Submission
from matformer.server.shards import ShardedMaster, ShardGroup, hashes_of
from matformer.server.state import RunState
from matformer.server.tiers import Capabilities, TierAssignment, check_speed
from matformer.server.update_log import UpdateLog
from matformer.server.update_steps import Carried
from matformer.server.work import work_order

SAVE_INTERVAL_S = 1.0  # joins, leaves and refusals reach state.json at most this often
RETRY_AFTER_S = 0.5  # how soon a waiting member asks GetRound again, at most
MIN_RETRY_AFTER_S = 0.05  # ... and at least, when work is expected for it sooner

__all__ = ["ClosedRound", "Coordinator"]

log = logging.getLogger("matformer.server")


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
        self._dense_bytes: dict[int, int] = {}  # per tier: dense_bytes
        self._lock = threading.RLock()
        self._traffic = threading.Lock()  # members' download counters (downloaded)
        # notified after every close; a lock of its own, so that a thousand GetUpdates
        # woken at once by a close queue there, not on the lock every heartbeat takes
        self._committed = threading.Condition(threading.Lock())
        self.worker = CloseWorker(self.advance)  # closes rounds once run_closes runs
        self.history = RunHistory(lambda: self.state, clock)
        saved = RunState.load(self.dir)
        self.reader, order = work_order(Mdat.open(config.data.path), config, saved)
        self.log = UpdateLog(self.dir / "updates")
        self.tier_ids = config.tiers.tier_ids()
        self.checkpoints = CheckpointStore(self.dir / "checkpoints", self.model_config,
                                           config.tiers.allowed, config.data,
                                           mixes=config.tiers.layer_mixes)
        self.ledger = TrainedLedger(self.dir)
        self.gate = SubmissionGate(self.shapes,
                                   SubmissionLimits(config.compression, config.faults))
        # how each round's results become its step ([policy]; server/policies/)
        self.policy = config.policy.build(config.update, peer_clip=config.faults.peer_clip)
        self.writer = CheckpointWriter(  # state and save looked up when used, not now
            self._lock, self.checkpoints, config.checkpoint, self.history, self.log,
            state=lambda: self.state, save=lambda: self.save(), mark_unsaved=self.mark_unsaved)
        # called (lock held) after each round that moved the master; quick, never calling back
        self.round_closed: list[Callable[[ClosedRound], None]] = []
        # joins, leaves and refusals reach state.json together, at most every SAVE_INTERVAL_S
        self._unsaved, self._saved_at = False, -math.inf
        self.shards: ShardGroup | None = None  # the close's other processes ([coordinator])
        if config.coordinator.shards > 1:  # the root keeps none of the weights
            where = config.coordinator
            self.shards = ShardGroup.start(self.shapes, where.shards,
                                           tied=self.model_config.tie_word_embeddings,
                                           host=where.shard_host, port=where.shard_port,
                                           wait_s=where.shard_wait_s)
        try:
            self._start(config, saved, order, initial)
        except BaseException:
            if self.shards is not None:
                self.shards.stop()
            raise

    def _start(self, config: RunConfig, saved: RunState | None, order: Any,
               initial: Mapping[str, Tensor] | None) -> None:
        """The parts, from the saved run or a new one (``__init__``)."""
        start = resume.Start(  # state, queue, save and hashes looked up when used, not now
            config=config, model_config=self.model_config, reader=self.reader, log=self.log,
            ledger=self.ledger, checkpoints=self.checkpoints, writer=self.writer,
            history=self.history, policy=self.policy, tied=self.tied,
            tier_hashes=lambda tiers, master: self.tier_hashes(tiers, master),
            save=lambda: self.save(), current_state=lambda: self.state,
            current_queue=lambda: self.queue, shards=self.shards)
        self.state, self.membership, self.queue = resume.records(start, saved, order)
        self.pipeline = RoundPipeline(config, self.membership, self.history, self.queue,
                                      self._length)
        self.admissions = Admissions(  # save looked up when used, not now
            self.membership, self.pipeline, self.history, config.faults, clock=self.clock,
            save=lambda: self.save(), mark_unsaved=self.mark_unsaved)
        self.closer = RoundClose(  # save and hashes looked up when used, not now
            config, self.policy, lock=self._lock, committed=self._committed,
            state=lambda: self.state, queue=self.queue, membership=self.membership,
            pipeline=self.pipeline, history=self.history, update_log=self.log,
            ledger=self.ledger, checkpoints=self.checkpoints, writer=self.writer,
            clock=self.clock, save=lambda: self.save(), tied=self.tied,
            tier_hashes=lambda tiers, master: self.tier_hashes(tiers, master),
            hooks=self.round_closed)
        master, carried = resume.master(start, saved, initial)
        if self.shards is not None and not isinstance(master, ShardedMaster):  # a new run's
            master, carried = self.shards.adopt(dict(master), carried), Carried()
        self.closer.master, self.closer.carried = master, carried
        # what the member API serves: the updates and checkpoints members catch up from,
        # the layouts results must have, the model's schema hash
        self.catch_up = CatchUp(self.log, self.checkpoints, self.regions, config.tiers.ids(),
                                logged=self.logged_rounds, latest=self.latest_checkpoint,
                                wait=self.wait_for_round, tier_ids=self.tier_ids)
        self.round_closed.append(self.catch_up.closed)
        self.layouts = ResultLayouts(config.compression.build(), self.shapes, self.regions,
                                     config.tiers.ids())
        self.schema_hash = canonical_schema_hash(self.model_config, self.shapes)

    # -- the member API (server/member_api.py): what the gRPC service asks ---------------

    def admit(self, ask: JoinAsk) -> Joined:
        """A Join: its credentials (``joins.credentials``), run, model and kind
        (``joins.check_join``) checked, then ``join``."""
        key = credentials(self.config.auth, self.config.keys_path, ask.join_token,
                          relay=ask.capabilities.relay)
        check_join(ask, run_id=self.config.run.id, schema_hash=self.schema_hash,
                   policy=self.policy)
        member, tier, token = self.join(ask.capabilities, key=key,
                                        previous_session=ask.previous_session)
        stop = self.config.round  # [round] rounds counts for progress when it comes first
        rounds_first = stop.rounds is not None and stop.rounds == stop.planned_rounds
        return Joined(client_id=member.client_id, session_token=token, tier=tier,
                      round=self.closed_rounds(), checkpoint=self.catch_up.checkpoint(tier.tier),
                      settings=self.run_settings(), schema_hash=self.schema_hash,
                      rounds_planned=stop.rounds if rounds_first else 0,
                      tokens_planned=stop.tokens or 0)

    def work(self, client_id: str, after: int | None = None) -> RoundAssignment | Waiting:
        """A GetRound: the member's oldest assignment not yet submitted (after ``after``),
        else when to ask again (sooner when work is expected sooner), or that the run is
        over. Counts as a heartbeat."""
        self._beat(client_id)
        self._advance()  # asking for work may open the next round
        with self._lock:
            closed, tokens = self.state.round, self.state.tokens
        if self.phase == "finished":
            return Waiting(round=closed, run_tokens=tokens, finished=True)
        assignment = self.assignment_for(client_id, after)
        if assignment is not None:
            return assignment
        expected = self.next_work_in(client_id)
        retry = RETRY_AFTER_S if expected is None else min(
            RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, expected))
        return Waiting(round=closed, run_tokens=tokens, retry_after_s=retry)

    def sequences(self, client_id: str, ids: Sequence[int]) -> Iterator[tuple[int, Tensor]]:
        """The assigned sequences asked for, each once (``gate.check_fetch`` refuses the
        rest before any is read)."""
        held = {i for a in self.pending(client_id) for i in a.sequence_ids}
        check_fetch(client_id, ids, held, data_size=len(self.reader))
        return ((i, torch.from_numpy(self.reader[i].copy())) for i in ids)

    def expects(self, client_id: str, header: SubmitHeader) -> Expected:
        """The assignment a submission's header names (``_header``) and the layout of
        each result it may hold: a relay's partials per tier region, a member's at its
        assignment's tier."""
        with self._lock:
            self.pipeline.attempted(client_id)  # late or not: it works
            rnd, assigned = self._header(client_id, header.round, header.assignment_id)
            self.pipeline.arrives(client_id, assigned.assignment_id)
        if rnd is None:  # a late result: it has until the next round's close to arrive
            assigned = dataclasses.replace(
                assigned, deadline=self.clock() + self.config.round.deadline_s)
        if self.membership.get(client_id).relay:
            return Expected(assigned, self.layouts.partials(), partials=True)
        return Expected(assigned, self.layouts.of(assigned.tier))

    def submit_results(self, client_id: str, header: SubmitHeader,
                       results: Sequence[SparseResult], *, wire_bytes: int) -> None:
        """``submit``, as a submission's header says."""
        self.submit(client_id, header.round, results, loss=header.loss,
                    train_seconds=header.train_seconds, assignment_id=header.assignment_id,
                    wire_bytes=wire_bytes, missed=header.missed_ids,
                    tier_losses=[(t.tier, t.tokens, t.loss) for t in header.tier_losses])

    def max_submission_bytes(self) -> int:
        return self.config.faults.max_submission_bytes

    def update_rounds(self, client_id: str, since_round: int, tier: int | None = None,
                      wait_s: float = 0.0) -> Iterator[list[Message]]:
        """``CatchUp.rounds`` at ``tier``, default the member's (a replica's lags a move by a
        round or two)."""
        member_tier = self.membership.get(client_id).tier
        return self.catch_up.rounds(since_round, member_tier if tier is None else tier, wait_s)

    def checkpoint(self, client_id: str) -> ServedCheckpoint:
        """Where the member starts: the latest checkpoint, at its tier."""
        return self.catch_up.checkpoint(self.membership.get(client_id).tier)

    def checkpoint_chunks(self, path: str) -> Iterator[Message]:
        return self.catch_up.chunks(path)

    def run_settings(self) -> RunSettings:
        """What a member needs to train as the run does."""
        return self.config.member_settings(self.reader.fingerprint)

    def closed_rounds(self) -> int:
        return self.state.round

    @property
    def run_tokens(self) -> int:
        return self.state.tokens

    @property
    def sequence_length(self) -> int:
        return self.config.data.max_seq_len

    # -- calls from clients -------------------------------------------------------------

    def join(self, capabilities: Capabilities, *, key: KeyHolder | None = None,
             previous_session: str | None = None) -> tuple[Member, TierAssignment, str]:
        """Admit a client: its member record, tier assignment and session token
        (``server/joins.py``, ``Admissions``: who may take a name, and how fast joins come)."""
        with self._lock:
            joined = self.admissions.join(capabilities, key=key,
                                          previous_session=previous_session)
            self._unsaved = True  # written by advance, at most every SAVE_INTERVAL_S
        self._advance()
        return joined

    def heartbeat(self, client_id: str, *, tokens_per_second: float | None = None,
                  relayed: Sequence[tuple[str, int, float]] = ()) -> RoundAssignment | None:
        """Mark the client alive (and take its measured speed, if it reports one; a relay's
        list of its members, if it sends one); its oldest assignment not yet submitted, if
        any. A beat changes only its member's record: with the close worker running it
        leaves the run's steps (deadlines, expiry, opening rounds) to the worker's tick, so
        that a thousand members beating every few seconds hold the lock for a moment each,
        not for a pass over every member each."""
        self._beat(client_id, tokens_per_second, relayed)
        if not self.worker.running:
            self.advance()  # no close worker (a test, a tool): this call moves the run on
        return self.assignment_for(client_id)

    def _beat(self, client_id: str, tokens_per_second: float | None = None,
              relayed: Sequence[tuple[str, int, float]] = ()) -> None:
        """Mark the member alive, with what its beat reports; its own record alone."""
        if tokens_per_second is not None:
            check_speed(tokens_per_second, client_id)
        with self._lock:
            self._beat_locked(client_id, tokens_per_second, relayed, self.clock())

    def _beat_locked(self, client_id: str, tokens_per_second: float | None,
                     relayed: Sequence[tuple[str, int, float]], now: float) -> None:
        member = self.membership.heartbeat(client_id, now=now)
        if tokens_per_second is not None:
            self.membership.reported(client_id, tokens_per_second)
        if relayed or member.relayed:
            member.relayed = check_relayed(relayed, member.relay, self.config.tiers.ids())
            member.relayed_tiers = sorted({*member.relayed_tiers,
                                           *(m["tier"] for m in member.relayed)})

    def beat_news(self) -> tuple[int, dict[str, str]]:
        """What the heartbeat process answers from: the rounds closed, and the excluded
        members by id with why."""
        return self.state.round, dict(self.membership.excluded)

    def apply_beats(self, beats: Sequence[Beat]) -> None:
        """Beats the heartbeat process answered (server/heartbeats.py), under one hold of the
        lock, each dated when the door took it. A beat of a member that has gone, or whose
        report the run refuses, is dropped (the latter with a warning)."""
        with self._lock:
            now, taken = self.clock(), time.monotonic()
            for beat in beats:
                try:
                    if beat.tokens_per_second is not None:
                        check_speed(beat.tokens_per_second, beat.client_id)
                    self._beat_locked(beat.client_id, beat.tokens_per_second, beat.relayed,
                                      now - max(0.0, taken - beat.at))
                except UnknownClient:
                    continue  # dropped since; its next call here tells it
                except (BadCapabilities, BadReport) as err:
                    log.warning("a heartbeat of %s was dropped: %s", beat.client_id, err)

    def leave(self, client_id: str, reason: str = "") -> None:
        """Remove a member; its unsubmitted ids go back to the queue."""
        with self._lock:
            self.admissions.remove(self.membership.get(client_id), reason or "left the run",
                                   dropped="left the run")
            self._unsaved = True
        self._advance()

    def exclude(self, client_id: str, reason: str) -> None:
        """Remove a member for good (``Admissions.exclude``); UnknownClient for a non-member."""
        with self._lock:
            self.admissions.exclude(client_id, reason)
        self._advance()

    def _header(self, client_id: str, round_index: int, assignment_id: str | None
                ) -> tuple[OpenRound | None, RoundAssignment]:
        """(lock held) The round and assignment a submission's header names; no round for
        a late result (``RoundPipeline.late_work``)."""
        now = self.clock()
        return self.gate.header(
            self.pipeline.collecting, client_id, round_index, assignment_id, now=now,
            finished=self.state.finished,
            late=lambda client, index, aid: self.pipeline.late_work(client, index, aid, now=now))

    def submit(self, client_id: str, round_index: int, results: Sequence[SparseResult], *,
               loss: float | None = None, train_seconds: float | None = None,
               assignment_id: str | None = None, wire_bytes: int = 0,
               missed: Sequence[int] = (),
               tier_losses: Sequence[tuple[int, int, float]] = ()) -> None:
        """Take a client's results for a round being collected, all or none (the gate's
        BadResult keeps none; ``RoundPipeline.keep``). The results are checked without the
        lock, the header again under it when they are kept. A relay's are partial sums,
        ``missed`` names the sequences of its assignment that its members did not deliver
        (they go back to the queue), and ``tier_losses`` its members' loss per tier
        (``(tier, tokens, loss)`` each)."""
        with self._lock:
            sender = self.membership.heartbeat(client_id, now=self.clock())
            self.pipeline.attempted(client_id)
            relay, relayed_tiers = sender.relay, list(sender.relayed_tiers)
        self._advance()  # a round past its deadline ends before late results are looked at
        with self._lock:
            _, assigned = self._header(client_id, round_index, assignment_id)
        losses: dict[int, tuple[float, int]] = {}
        if relay:
            delivered = assigned.without(missed, self._length)
            kept = self.gate.partials(
                assigned, [self.regions(t) for t in self.config.tiers.ids()], results,
                tokens=delivered.tokens, loss=loss, train_seconds=train_seconds)
            # the tiers its members were at, as its heartbeats listed them
            losses = check_tier_losses(tier_losses, relayed_tiers, delivered.tokens)
        elif missed:
            raise MissedNotAssigned("only a relay names missed sequences; a member submits "
                                    "its whole assignment or nothing.")
        elif tier_losses:
            raise BadReport("only a relay reports losses per tier; a member reports its own "
                            "loss, which counts at its tier.")
        else:
            kept = self.gate.results(assigned, self.regions(assigned.tier), results,
                                     loss=loss, train_seconds=train_seconds)
        with self._lock:
            rnd, assigned = self._header(client_id, round_index, assignment_id)
            if relay:
                delivered = assigned.without(missed, self._length)
            submission = Submission(kept, loss, self.clock(), wire_bytes, losses)
            work, undelivered = (delivered, missed) if relay else (assigned, ())
            how = dict(train_seconds=train_seconds, dense_bytes=self.dense_bytes(assigned.tier),
                       missed=undelivered)
            if rnd is None:  # late: folded into the next round to close
                self.pipeline.keep_late(assigned, work, submission, **how)
            else:
                self.pipeline.keep(rnd, work, submission, **how)
        self._advance()  # the last submission makes the round ready to close

    def rejected(self, client_id: str, error: Exception) -> str:
        """Count a refused submission against the client; at [faults] max_rejections it is
        excluded. The words to add to the refusal's message ("" when nothing follows)."""
        with self._lock:
            consequence = self.admissions.count_refusal(client_id, error)
        self._advance()  # the round may have waited only for this member
        return consequence

    def authenticate(self, token: str) -> str:
        """The client id a session token belongs to. Raises Excluded for an excluded
        client's token, SessionInvalid for an unknown, revoked or expired one."""
        client_id = self.membership.sessions.client_of(token)
        if client_id is None:
            raise SessionInvalid("unknown, revoked or expired session token; call Join again.")
        # without the lock: every call of every member asks, and one look into a dict sees
        # it before or after an exclusion, either of which the lock would give too
        reason = self.membership.excluded.get(client_id)
        if reason is not None:
            raise Excluded(f"{client_id} was excluded from the run: {reason}")
        return client_id

    def assignment_for(self, client_id: str, after: int | None = None
                       ) -> RoundAssignment | None:
        """The member's oldest assignment not yet submitted (in a round after ``after``)."""
        with self._lock:
            return self.pipeline.assignment_for(client_id, after)

    def pending(self, client_id: str) -> list[RoundAssignment]:
        """The member's assignments not yet submitted, oldest first."""
        with self._lock:
            return self.pipeline.pending(client_id)

    def next_work_in(self, client_id: str) -> float | None:
        """Seconds until ``client_id`` likely has work again (``RoundPipeline.next_work_in``)."""
        with self._lock:
            under_way = self.closer.under_way
            started = under_way.started if under_way is not None else None
            return self.pipeline.next_work_in(client_id, self.clock(), self.closer.close_s,
                                              started)

    def logged_rounds(self, round_index: int) -> range:
        """Rounds ``round_index``, ..., the last committed one (UpdatesPruned: not logged)."""
        with self._lock:
            base = self.state.log_start()
            if round_index < base:
                latest = self.state.checkpoints[-1]
                raise UpdatesPruned(f"updates before round {base} are pruned; load checkpoint "
                                    f"round-{latest} (latest_checkpoint) and ask again.")
            return range(round_index, self.state.round)

    def wait_for_round(self, round_index: int, timeout_s: float) -> None:
        """Until round ``round_index`` is committed, the run finished, or ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        with self._committed:  # the close changes round and finished before it notifies
            while self.state.round <= round_index and not self.state.finished:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self._committed.wait(left)

    def updates_since(self, round_index: int) -> list[RoundUpdate]:
        """``logged_rounds``' updates, read without the lock (a close prunes the log only
        after its checkpoint is listed)."""
        return [self.log.read(r) for r in self.logged_rounds(round_index)]

    def latest_checkpoint(self) -> CheckpointRef:
        """The latest listed checkpoint, where a joining client starts."""
        with self._lock:
            return self.checkpoints.ref(self.state.checkpoints[-1])

    @property
    def master(self) -> dict[str, Tensor]:
        """The run's weights after the last committed round (the close owns them)."""
        return self.closer.master

    @property
    def carried(self) -> Carried:
        """What the next close carries over (``RoundClose.carried``)."""
        return self.closer.carried

    # -- the state machine --------------------------------------------------------------

    @property
    def phase(self) -> str:
        if self.state.finished:
            return "finished"
        p = self.pipeline
        return "waiting" if not p.collecting and p.closing is None else "collecting"

    @property
    def current_round(self) -> OpenRound | None:  # the oldest round being collected
        return self.pipeline.collecting[0] if self.pipeline.collecting else None

    def advance(self) -> None:
        """Move the rounds on and close each that is ready, in this thread (the close
        worker's, or a test's; members' calls never close a round once the worker runs)."""
        while True:
            with self._lock:
                closing = self._step(detach=True)
            if closing is None:
                return
            self.closer.under_way = closing
            try:
                self.closer.close(closing)
            finally:
                self.closer.under_way = None

    def _advance(self) -> None:
        """What a member's call does after changing the run: with the close worker running,
        the cheap steps, and a wake-up for the worker when a round is ready; else
        ``advance``."""
        if not self.worker.running:
            self.advance()
            return
        with self._lock:
            self._step(detach=False)
            if self.pipeline.ready(self.clock()) is not None:
                self.worker.wake()

    def run_closes(self, stopping: threading.Event) -> None:
        """The close worker (``CloseWorker.run``): a server's thread of its own."""
        self.worker.run(stopping)

    def _step(self, *, detach: bool) -> Closing | None:
        """(lock held) Expire sessions and move the rounds in flight on
        (``RoundPipeline.step``); with ``detach``, the close of the round to close now."""
        now = self.clock()
        self.admissions.expire_sessions(now)
        rnd = None
        if not self.state.finished:
            rnd, ended = self.pipeline.step(now, committed=self.state.round,
                                            room=self.closer.room,
                                            last=self.config.round.rounds, detach=detach)
            for client_id, why in (self.pipeline.take_exclusions()
                                   | self.closer.take_exclusions()).items():
                if client_id in self.membership.members:
                    self.admissions.exclude(client_id, why)  # saves
            if ended:
                self.save()
        if rnd is not None:
            return self.closer.closing_of(rnd)
        if self._unsaved and now - self._saved_at >= SAVE_INTERVAL_S:
            self.save()
        return None

    def flush(self) -> None:
        """Finish the checkpoint being written, and write state.json if it changed since
        the last write (a server stopping calls this)."""
        self.writer.wait()
        with self._lock:
            if self._unsaved:
                self.save()

    def close(self) -> None:
        """``flush``, then close the tracker: a server stopping calls this."""
        try:
            self.flush()
            with self._lock:
                self.closer.close_tracker()
        finally:
            if self.shards is not None:
                self.shards.stop()

    def snapshot(self, *, since_round: int | None = 0, events_after: int | None = -1
                 ) -> dict[str, Any]:
        """What the status API shows, copied under the lock (``server/status.py``)."""
        with self._lock:
            return status.snapshot(self.config, self.state, self.membership, self.history,
                                   self.current_round, phase=self.phase, now=self.clock(),
                                   since_round=since_round, events_after=events_after)

    def downloaded(self, client_id: str, nbytes: int, *, rounds: int = 0) -> None:
        """Count what the service sent a member (``rounds``: round updates among it)."""
        # counters of their own lock: every GetUpdates ends here, a thousand at once after
        # a close, and the coordinator's lock is the one heartbeats wait for
        member = self.membership.members.get(client_id)
        if member is not None:
            dense = rounds * self.dense_bytes(member.tier)
            with self._traffic:
                member.bytes_down += nbytes
                member.dense_bytes_down += dense

    def dense_bytes(self, tier: int) -> int:
        """float32 bytes of the weights a tier holds: a dense gradient's, or weights', size
        (counted once per tier: every download and submission asks)."""
        if tier not in self._dense_bytes:
            self._dense_bytes[tier] = DENSE_BYTES_PER_VALUE * sum(
                math.prod(region_shape(r)) for r in self.regions(tier).values())
        return self._dense_bytes[tier]

    def regions(self, tier: int) -> dict[str, Region]:
        """Canonical name → the region of the universal tensor that ``tier`` covers."""
        if tier not in self._regions:
            self._regions[tier] = tier_regions(self.shapes, self.model_config,
                                               self.tier_ids.resolve(tier))
        return self._regions[tier]

    def tier_hashes(self, tiers: Sequence[int], master: Mapping[str, Tensor] | None = None
                    ) -> dict[int, str]:
        """Weight hash of the master (or ``master``) at each tier, as clients compare it."""
        master = self.master if master is None else master
        return hashes_of(master, {t: self.regions(t) for t in sorted(set(tiers))})

    # -- persistence --------------------------------------------------------------------

    def save(self) -> None:
        """(lock held) state.json as of the last committed round: rounds in flight are not in
        it, so their ids wait at the front of the saved queue."""
        self.state.queue = self.pipeline.saved_queue()
        self.state.membership = self.membership.to_dict()
        try:
            self.state.save(self.dir)
            self._unsaved, self._saved_at = False, self.clock()
        except OSError as err:
            raise RunDirectoryUnavailable(
                f"the coordinator cannot write {self.dir.name}/state.json "
                f"({type(err).__name__}: {err.strerror or err}); retry shortly.") from err

    def mark_unsaved(self) -> None:
        """(lock held) state.json changed in memory: written with the next save or flush."""
        self._unsaved = True

    def tied(self, master: dict[str, Tensor]) -> dict[str, Tensor]:
        """With tied embeddings the head is the embedding: clients update it under
        ``model.embed_tokens.weight`` only, so the master's ``lm_head.weight`` follows it
        (a sharded master's shards do this themselves)."""
        if self.model_config.tie_word_embeddings:
            master["lm_head.weight"] = master["model.embed_tokens.weight"]
        return master

    def _length(self, sequence_id: int) -> int:
        return len(self.reader[sequence_id])
