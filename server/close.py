"""The close of a round, as a transaction (docs/architecture.md, "The coordinator").

    closer = RoundClose(config, policy, lock=..., state=..., queue=..., ...)
    closing = closer.closing_of(rnd)   # (lock held) what the close reads, fixed
    closer.close(closing)              # (no lock) compute, then commit under the lock

The heavy part (aggregation, the broadcast's steps, the new master, its hashes, the update
log, the ledger line, the last checkpoint) runs without the coordinator's lock, beside the
master it replaces; then, under the lock, the round's records and state.json, and only then
does the close take the new master. A failed write puts memory and disk back as they
were and collects the round again. The close runs on the coordinator's close worker
(``CloseWorker``, run by ``Coordinator.run_closes``), never inside a member's call.
"""

from __future__ import annotations

import logging
import shutil
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from torch import Tensor

from matformer.modeling.compression import RoundUpdate, SparseResult, UpdateConfig
from matformer.modeling.tracking import NoTracker, open_tracker
from matformer.server.errors import RunDirectoryUnavailable
from matformer.server.rounds import OpenRound, RoundAssignment
from matformer.server.run_log import round_line
from matformer.server.scores import ScoreJudge, agreement
from matformer.server.shards import ShardLost, close_master, settle, state_bytes
from matformer.server.update_steps import ARITHMETIC, Carried

if TYPE_CHECKING:
    from matformer.modeling.tracking import Tracker
    from matformer.server.checkpoint_writer import CheckpointWriter
    from matformer.server.checkpoints import CheckpointStore
    from matformer.server.config import RunConfig
    from matformer.server.history import RunHistory
    from matformer.server.ledger import TrainedLedger
    from matformer.server.membership import Membership
    from matformer.server.pipeline import RoundPipeline
    from matformer.server.policies import RoundPolicy
    from matformer.server.state import RunState
    from matformer.server.update_log import UpdateLog
    from matformer.server.work import WorkQueue

# Free space a round needs before it opens, in multiples of the master's size: the update
# (at most the master's size), a checkpoint and its tier slices (under twice), state.json.
CLOSE_RESERVE = 3
TICK_S = 0.5  # how often the close worker looks at deadlines when nothing wakes it
# the round record's figures that go to the tracker, as round/<key>
TRACKED = ("duration_s", "slowest_s", "tokens", "clients", "bytes_sent", "bytes_dense")

log = logging.getLogger("matformer.server")


@dataclass(frozen=True, kw_only=True, slots=True)
class ClosedRound:
    """What ``Coordinator.round_closed`` hooks are told of a round that moved the master."""

    round: int
    tiers: set[int]  # the tiers of the clients whose results it aggregated
    before: Mapping[str, Tensor]  # the master before (canonical names; never changed after)
    after: Mapping[str, Tensor]  # ... and after the round
    update: RoundUpdate  # what the update log holds of the round


@dataclass(kw_only=True, slots=True)
class Closing:
    """A round taken out of collection to be closed: what its close reads, fixed under the
    lock when it was detached, so the heavy part can run without it."""

    rnd: OpenRound
    round: int
    delivered: dict[str, RoundAssignment]  # the submitters' assignments, in assignment order
    late: list[RoundAssignment]  # earlier rounds' work whose late results it folds in
    by_name: dict[str, list[SparseResult]]  # canonical name → results, in that order
    update: UpdateConfig
    tiers: set[int]  # whose hashes the log records: every allowed tier and every trained one
    tokens_after: int  # the run's tokens once this round counts
    finishes: bool  # the run ends with this round
    checkpoint: bool  # a checkpoint follows this round
    ledger_bytes: int  # the ledger's size before this round's line
    started: float  # clock time the close began
    broken: list[str] = field(default_factory=list)  # parameters the update would break
    logged: RoundUpdate | None = None  # what compute logged
    scores: dict[str, float] = field(default_factory=dict)  # client → its agreement
    carried: Carried = field(default_factory=Carried)  # residual and momentum after it
    master: Mapping[str, Tensor] | None = None  # the new master, until committed or dropped


class CloseWorker:
    """The thread a server closes rounds on, so that no member's call waits for a close:
    woken when a round is ready, and every TICK_S for the deadlines."""

    def __init__(self, advance: Callable[[], None]) -> None:
        self.advance = advance  # Coordinator.advance: closes what is ready, in this thread
        self.running = False
        self.fatal: ShardLost | None = None  # why no round can close before a restart
        self._wake = threading.Event()

    def wake(self) -> None:
        self._wake.set()

    def run(self, stopping: threading.Event) -> None:
        """Close each round as soon as it is ready until ``stopping`` is set."""
        self.running = True
        try:
            while not stopping.is_set():
                self._wake.wait(TICK_S)
                self._wake.clear()
                try:
                    self.advance()
                except ShardLost as err:  # the server stops; a restart resumes the run
                    self.fatal = err
                    return
                except Exception:  # a failing close must not stop the deadlines
                    log.exception("advancing the run failed; retrying in %.1f s", TICK_S)
        finally:
            self.running = False


class RoundClose:
    """The close of each round, as a part: it owns the master weights and the state carried
    from round to round, the run's tracker, and what it remembers of the last close; it is
    given the stores a close writes (the run state, the work queue, the membership, the
    rounds in flight, the history, the update log, the ledger, the checkpoints and their
    writer), the round policy, the coordinator's lock and the hooks told of each round."""

    def __init__(self, config: RunConfig, policy: RoundPolicy, *, lock: threading.RLock,
                 committed: threading.Condition, state: Callable[[], RunState],
                 queue: WorkQueue, membership: Membership, pipeline: RoundPipeline,
                 history: RunHistory, update_log: UpdateLog, ledger: TrainedLedger,
                 checkpoints: CheckpointStore, writer: CheckpointWriter,
                 clock: Callable[[], float], save: Callable[[], None],
                 tied: Callable[[dict[str, Tensor]], dict[str, Tensor]],
                 tier_hashes: Callable[[list[int], Mapping[str, Tensor]], dict[int, str]],
                 hooks: list[Callable[[ClosedRound], None]]) -> None:
        self.config, self.policy, self.dir = config, policy, Path(config.run.dir)
        self.lock, self.committed, self._state = lock, committed, state
        self.queue, self.membership, self.pipeline = queue, membership, pipeline
        self.history, self.log, self.ledger = history, update_log, ledger
        self.checkpoints, self.writer, self.clock, self.save = checkpoints, writer, clock, save
        self.tied, self.tier_hashes, self.hooks = tied, tier_hashes, hooks
        self.master: dict[str, Tensor] = {}  # the run's weights, canonical names
        # the broadcast's residual, the outer momentum and the policy's own buffers, carried
        # from round to round and saved with each checkpoint (server/outer_state.py)
        self.carried = Carried()
        self.tracker: Tracker | None = None  # opened with the first round it records
        self.under_way: Closing | None = None  # the close being computed, if any
        self.close_s = 0.0  # how long the last close took
        self.write_failure: str | None = None  # the last failed close's error, logged once
        self.waiting_for_disk = False  # a round waits for free space (said once)
        self.judge = ScoreJudge(config.faults)
        # members whose scores keep pushing against their peers': client → why; the
        # coordinator's admissions exclude them (``take_exclusions``)
        self.excluding: dict[str, str] = {}

    @property
    def state(self) -> RunState:
        return self._state()

    def take_exclusions(self) -> dict[str, str]:
        """(lock held) The members the last closes found to push against their peers."""
        taken, self.excluding = self.excluding, {}
        return taken

    def close_tracker(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
            self.tracker = None

    def closing_of(self, rnd: OpenRound) -> Closing:
        """(lock held) What the close of ``rnd`` reads, fixed now."""
        r = rnd.index
        delivered = {client: a for client, a in rnd.assignments.items()
                     if client in rnd.submissions}
        by_name: dict[str, list[SparseResult]] = {}
        submissions = [rnd.submissions[client] for client in delivered]
        for submission in [*submissions, *(f.submission for f in rnd.late)]:
            # assignment order, then the late results': aggregation order is deterministic
            for result in submission.results:
                by_name.setdefault(result.name, []).append(result)
        late = [f.assignment for f in rnd.late]
        tokens_after = self.state.tokens + sum(a.tokens for a in [*delivered.values(), *late])
        stop = self.config.round
        finishes = (stop.rounds is not None and r + 1 >= stop.rounds) or (
            stop.tokens is not None and tokens_after >= stop.tokens)
        config = self.config
        return Closing(rnd=rnd, round=r, delivered=delivered, late=late, by_name=by_name,
                       update=config.update.build(r, stop.planned_rounds, config.compression),
                       tiers=set(config.tiers.ids()) | {
                           a.tier for a in [*delivered.values(), *late]},
                       tokens_after=tokens_after, finishes=finishes,
                       checkpoint=finishes or (r + 1) % config.checkpoint.every_rounds == 0,
                       ledger_bytes=self.ledger.size(), started=self.clock())

    def close(self, closing: Closing) -> None:
        """Close a detached round: compute without the lock, commit under it. If a write
        fails (disk full, I/O error), memory and disk are put back as they were before the
        close, the round is collected again, and RunDirectoryUnavailable names the error; the
        next close tries again."""
        rnd = closing.rnd
        try:
            master = self._compute(closing)
        except Exception as err:
            with self.lock:
                self._drop(closing)
                self._undo_disk(closing)
                self.pipeline.reopen(rnd)
                self._failed(rnd, err)
        with self.lock:
            # what committing changes in memory, each store's own: put back if state.json
            # cannot be written
            stores = (self.state, self.queue, self.membership, self.pipeline)
            before = [(store, store.snapshot()) for store in stores]
            excluding = dict(self.excluding)  # the scores' verdicts, which _record adds to
            try:
                self._commit(closing, master)
            except Exception as err:
                for store, snapshot in before:
                    store.restore(snapshot)
                self.excluding = excluding
                self._drop(closing)
                self._undo_disk(closing)
                self._failed(rnd, err)
            if master is not None:  # recorded and saved: now the run's tracker hears of it
                self._track(closing.round)
            self.pipeline.closing = None
            self.write_failure = None
            self.close_s = self.clock() - closing.started
            if master is not None:
                closed = ClosedRound(round=closing.round, before=self.master, after=master,
                                     tiers={a.tier for a in [*closing.delivered.values(),
                                                             *closing.late]},
                                     update=closing.logged)
                settle(master, commit=True)
                self.master, self.carried = master, closing.carried
                for hook in self.hooks:
                    hook(closed)
                if closing.checkpoint and not closing.finishes:
                    self.writer.start(closing.round + 1, master, closing.carried)
            else:
                self._drop(closing)
            if closing.finishes:
                self.pipeline.cancel("the run finished")
            self.writer.retire()
            with self.committed:  # its own lock (Coordinator.wait_for_round)
                self.committed.notify_all()

    def room(self) -> bool:
        """Whether the run directory has room for what closing a round writes (an update, a
        checkpoint with its slices, state.json); a round opens only then. Said once."""
        weights, carried = state_bytes(self.master, self.carried)
        need = CLOSE_RESERVE * weights + carried  # the carried state: with the checkpoint
        free = shutil.disk_usage(self.dir).free
        if free >= need:
            self.waiting_for_disk = False
            return True
        if not self.waiting_for_disk:
            self.waiting_for_disk = True
            why = (f"{free / 2**20:,.0f} MiB free in the run directory, {need / 2**20:,.0f} MiB "
                   "needed to close a round")
            log.error("no round opens: %s; free some space", why)
            self.history.event("disk", None, f"no round opens: {why}")
        return False

    def _compute(self, closing: Closing) -> dict[str, Tensor] | None:
        """(no lock) The new master, with the update logged, the ledger line and any last
        checkpoint written; None when the update would make a weight not finite (nothing is
        written then). Reads only what no other thread changes while a round closes."""
        policy = self.policy
        by_name = policy.inputs(closing.by_name)
        with ThreadPoolExecutor(1, thread_name_prefix="inputs") as beside:
            # a resume closes the round again from its inputs to rebuild what it carries
            # (outer_state.py); written while the round is computed, logged with it
            inputs = beside.submit(self.log.write_inputs, closing.round, by_name) \
                if policy.carries_state(closing.update.broadcast_topk) else None
            master, steps, carried, closing.broken = close_master(
                policy, closing.update, self.master, by_name, self.carried, self.tied)
            fields = None if inputs is None else {
                "inputs": inputs.result(), "outer": {**policy.record(), "arithmetic": ARITHMETIC}}
        closing.master = master
        if closing.broken:  # the limits on results make this unreachable; never serve it
            return None
        closing.carried = carried
        closing.scores = agreement({client: closing.rnd.submissions[client].results
                                    for client in closing.delivered})
        r = closing.round
        closing.logged = RoundUpdate(
            round=r, update=closing.update, steps=steps,
            hashes=self.tier_hashes(sorted(closing.tiers), master),
            coverage_tokens={n: sum(x.tokens for x in rs) for n, rs in by_name.items()})
        self.log.append(closing.logged, fields)
        self.ledger.record(r, [i for a in [*closing.delivered.values(), *closing.late]
                               for i in a.sequence_ids])
        if closing.checkpoint:
            self.writer.wait()  # one write at a time; also before the last one
            if closing.finishes:  # the run's last weights are listed before it is finished
                self.checkpoints.write(r + 1, master, carried)
        return master

    def _commit(self, closing: Closing, master: dict[str, Tensor] | None) -> None:
        """(lock held) The closed round in memory and state.json: the members' side, its
        records, the round counter and tokens, any checkpoint; or, for an update that would
        make a weight not finite, the round discarded and its ids requeued (with those of the
        rounds behind it, which were split for a master that did not come)."""
        rnd, r = closing.rnd, closing.round
        self.pipeline.settle(rnd)
        self.pipeline.closing = None  # committed or discarded: not held for the saved queue
        if master is None:
            for client in list(rnd.assignments):
                self.queue.requeue(rnd.assignments.pop(client).sequence_ids)
            self.pipeline.unfold(rnd)
            self.pipeline.cancel(f"round {r} was discarded")
            broken = closing.broken
            self.history.event(
                "discard", None, f"round {r} discarded: its update makes {broken[0]} (and "
                f"{len(broken) - 1} more) not finite; its sequences are requeued")
            self.save()
            return
        self._record(rnd, closing.by_name, closing.scores,
                     close_s=self.clock() - closing.started)
        self.state.round = r + 1
        self.state.tokens = closing.tokens_after
        self.state.finished = closing.finishes
        if closing.checkpoint and closing.finishes:
            self.state.checkpoints.append(r + 1)
            self.history.event("checkpoint", None, f"checkpoints/round-{r + 1}")
        self.save()

    def _failed(self, rnd: OpenRound, err: Exception) -> NoReturn:
        """(lock held) Re-raise a failed close: an error writing the run directory becomes
        RunDirectoryUnavailable (said once per distinct error), anything else as it is."""
        cause = err.__cause__ if isinstance(err, RunDirectoryUnavailable) else err
        if not isinstance(cause, OSError):
            raise err
        why = f"{type(cause).__name__}: {cause.strerror or cause}"
        if why != self.write_failure:
            self.write_failure = why
            log.error("round %d could not be written to %s (%s); it stays open and closes "
                      "once the run directory can be written", rnd.index, self.dir, why)
            self.history.event("disk", None, f"round {rnd.index} could not be saved ({why}); "
                               "it closes once the run directory can be written")
        raise RunDirectoryUnavailable(
            f"the coordinator cannot write its run directory ({why}); round {rnd.index} "
            "closes once it can. Retry shortly.") from err

    def _drop(self, closing: Closing) -> None:
        """A failed close's new master let go of (a sharded one's shards drop their part;
        a lost shard has nothing left to drop)."""
        if closing.master is not None:
            settle(closing.master, commit=False)
            closing.master = None

    def _undo_disk(self, closing: Closing) -> None:
        """(lock held) Remove what a failed close wrote: its logged update, ledger line and
        checkpoint (none of which needs free space)."""
        try:
            self.log.discard(closing.round)
            self.ledger.rewind(closing.ledger_bytes)
            self.writer.remove_unlisted()
        except OSError as err:  # a restart repairs the disk side from state.json
            log.warning("undoing round %d on disk failed: %s", closing.round, err)

    def _record(self, rnd: OpenRound, by_name: Mapping[str, list[SparseResult]],
                scores: Mapping[str, float], *, close_s: float) -> None:
        """(lock held) The completed round in the run's history, and each member's share of
        it and score; members whose scores keep pushing against their peers' are marked for
        exclusion."""
        tokens = sum(a.tokens for a in rnd.assignments.values())
        for client, submission in rnd.submissions.items():
            member = self.membership.members.get(client)
            if member is not None:
                member.last_round = rnd.index
                member.last_round_tokens = rnd.assignments[client].tokens
                member.last_round_share = member.last_round_tokens / tokens if tokens else 0.0
                member.last_round_seconds = submission.received_at - rnd.opened_at
                why = self.judge.add(member, scores.get(client))
                if why is not None:
                    self.excluding[client] = why
        self.history.loss(rnd)
        self.history.round(rnd, by_name, scores, close_s=close_s)
        log.info("%s", round_line(self.state, self.config.round, rnd))

    def _track(self, round_index: int) -> None:
        """(lock held) The round's record and losses to the run's tracker ([tracking]). A
        tracker that fails is said once and dropped: the rounds go on without it."""
        record = self.state.rounds[-1]
        scalars = {f"round/{key}": float(record[key]) for key in TRACKED}
        scalars |= {f"loss/tier_{tier}": points[-1][1] for tier, points in self.state.loss.items()
                    if points and points[-1][0] == round_index}
        try:
            if self.tracker is None:
                tracking = self.config.tracking
                self.tracker = open_tracker(tracking.kind, self.dir / "tensorboard",
                                            project=tracking.project, name=self.config.run.id,
                                            config={"run": self.config.run.id})
            self.tracker.log(round_index + 1, scalars)
            self.tracker.flush()
        except Exception as err:
            log.warning("[tracking] %s failed (%s); going on without it",
                        self.config.tracking.kind, err)
            self.tracker = NoTracker()
