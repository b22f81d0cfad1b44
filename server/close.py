"""The close of a round, as a transaction (docs/architecture.md, "The coordinator").

    closing = Closing.of(coordinator, rnd)   # (lock held) what the close reads, fixed
    close(coordinator, closing)              # (no lock) compute, then commit under the lock

The heavy part (aggregation, the broadcast's steps, the new master, its hashes, the update
log, the ledger line, the last checkpoint) runs without the coordinator's lock, beside the
master it replaces; then, under the lock, the round's records and state.json, and only then
does the coordinator take the new master. A failed write puts memory and disk back as they
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
from typing import TYPE_CHECKING, NoReturn

import torch
from torch import Tensor

from matformer.modeling.compression import RoundUpdate, SparseResult, UpdateConfig
from matformer.modeling.tracking import NoTracker, open_tracker
from matformer.server.errors import RunDirectoryUnavailable
from matformer.server.outer_state import carried_bytes
from matformer.server.rounds import OpenRound, RoundAssignment
from matformer.server.run_log import round_line
from matformer.server.update_steps import Carried

if TYPE_CHECKING:
    from matformer.server.coordinator import Coordinator

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
    carried: Carried = field(default_factory=Carried)  # residual and momentum after it

    @classmethod
    def of(cls, c: Coordinator, rnd: OpenRound) -> Closing:
        r = rnd.index
        delivered = {client: a for client, a in rnd.assignments.items()
                     if client in rnd.submissions}
        by_name: dict[str, list[SparseResult]] = {}
        for client in delivered:  # assignment order: aggregation order is deterministic
            for result in rnd.submissions[client].results:
                by_name.setdefault(result.name, []).append(result)
        tokens_after = c.state.tokens + sum(a.tokens for a in delivered.values())
        stop = c.config.round
        finishes = (stop.rounds is not None and r + 1 >= stop.rounds) or (
            stop.tokens is not None and tokens_after >= stop.tokens)
        return cls(rnd=rnd, round=r, delivered=delivered, by_name=by_name,
                   update=c.config.update.build(r, stop.planned_rounds, c.config.compression),
                   tiers=set(c.config.tiers.allowed) | {a.tier for a in delivered.values()},
                   tokens_after=tokens_after, finishes=finishes,
                   checkpoint=finishes or (r + 1) % c.config.checkpoint.every_rounds == 0,
                   ledger_bytes=c.ledger.size(), started=c.clock())


class CloseWorker:
    """The thread a server closes rounds on, so that no member's call waits for a close:
    woken when a round is ready, and every TICK_S for the deadlines."""

    def __init__(self, advance: Callable[[], None]) -> None:
        self.advance = advance  # Coordinator.advance: closes what is ready, in this thread
        self.running = False
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
                except Exception:  # a failing close must not stop the deadlines
                    log.exception("advancing the run failed; retrying in %.1f s", TICK_S)
        finally:
            self.running = False


def close(c: Coordinator, closing: Closing) -> None:
    """Close a detached round: compute without the lock, commit under it. If a write fails
    (disk full, I/O error), memory and disk are put back as they were before the close, the
    round is collected again, and RunDirectoryUnavailable names the error; the next close
    tries again."""
    rnd = closing.rnd
    try:
        master = _compute(c, closing)
    except Exception as err:
        with c._lock:
            _undo_disk(c, closing)
            c.pipeline.reopen(rnd)
            _failed(c, rnd, err)
    with c._lock:
        # what committing changes in memory, each store's own: put back if state.json
        # cannot be written
        stores = (c.state, c.queue, c.membership, c.pipeline)
        before = [(store, store.snapshot()) for store in stores]
        try:
            _commit(c, closing, master)
        except Exception as err:
            for store, snapshot in before:
                store.restore(snapshot)
            _undo_disk(c, closing)
            _failed(c, rnd, err)
        if master is not None:  # recorded and saved: now the run's tracker hears of it
            _track(c, closing.round)
        c.pipeline.closing = None
        c._write_failure = None
        c._close_s = c.clock() - closing.started
        if master is not None:
            closed = ClosedRound(round=closing.round, before=c.master, after=master,
                                 tiers={a.tier for a in closing.delivered.values()},
                                 update=closing.logged)
            c.master, c.carried = master, closing.carried
            for hook in c.round_closed:
                hook(closed)
            if closing.checkpoint and not closing.finishes:
                c.writer.start(closing.round + 1, master, closing.carried)
        if closing.finishes:
            c.pipeline.cancel("the run finished")
        c.writer.retire()
        c._committed.notify_all()


def room_to_close(c: Coordinator) -> bool:
    """Whether the run directory has room for what closing a round writes (an update, a
    checkpoint with its slices, state.json); a round opens only then. Said once."""
    need = (CLOSE_RESERVE * sum(t.numel() * t.element_size() for t in c.master.values())
            + carried_bytes(c.carried))  # saved with the checkpoint
    free = shutil.disk_usage(c.dir).free
    if free >= need:
        c.waiting_for_disk = False
        return True
    if not c.waiting_for_disk:
        c.waiting_for_disk = True
        why = (f"{free / 2**20:,.0f} MiB free in the run directory, {need / 2**20:,.0f} MiB "
               "needed to close a round")
        log.error("no round opens: %s; free some space", why)
        c.history.event("disk", None, f"no round opens: {why}")
    return False


def _compute(c: Coordinator, closing: Closing) -> dict[str, Tensor] | None:
    """(no lock) The new master, with the update logged, the ledger line and any last
    checkpoint written; None when the update would make a weight not finite (nothing is
    written then). Reads only what no other thread changes while a round closes."""
    policy = c.policy
    by_name = policy.inputs(closing.by_name)
    with ThreadPoolExecutor(1, thread_name_prefix="inputs") as beside:
        # a resume closes the round again from its inputs to rebuild what it carries
        # (outer_state.py); written while the round is computed, logged with it
        inputs = beside.submit(c.log.write_inputs, closing.round, by_name) \
            if policy.carries_state(closing.update.broadcast_topk) else None
        master, steps, carried = policy.close(closing.update.build(), c.master, by_name,
                                              c.carried)
        fields = None if inputs is None else {
            "inputs": inputs.result(), "outer": policy.record()}
    master = c.tied(master)
    closing.broken = [n for n, t in master.items() if not bool(torch.isfinite(t).all())]
    if closing.broken:  # the limits on results make this unreachable; never serve it
        return None
    closing.carried = carried
    r = closing.round
    closing.logged = RoundUpdate(
        round=r, update=closing.update, steps=steps,
        hashes=c.tier_hashes(sorted(closing.tiers), master),
        coverage_tokens={n: sum(x.tokens for x in rs) for n, rs in by_name.items()})
    c.log.append(closing.logged, fields)
    c.ledger.record(r, [i for a in closing.delivered.values() for i in a.sequence_ids])
    if closing.checkpoint:
        c.writer.wait()  # one write at a time; also before the last one
        if closing.finishes:  # the run's last weights are listed before it is finished
            c.checkpoints.write(r + 1, master, carried)
    return master


def _commit(c: Coordinator, closing: Closing, master: dict[str, Tensor] | None) -> None:
    """(lock held) The closed round in memory and state.json: the members' side, its
    records, the round counter and tokens, any checkpoint; or, for an update that would
    make a weight not finite, the round discarded and its ids requeued (with those of the
    rounds behind it, which were split for a master that did not come)."""
    rnd, r = closing.rnd, closing.round
    c.pipeline.settle(rnd)
    c.pipeline.closing = None  # committed or discarded: no longer held for the saved queue
    if master is None:
        for client in list(rnd.assignments):
            c.queue.requeue(rnd.assignments.pop(client).sequence_ids)
        c.pipeline.cancel(f"round {r} was discarded")
        broken = closing.broken
        c.history.event(
            "discard", None, f"round {r} discarded: its update makes {broken[0]} (and "
            f"{len(broken) - 1} more) not finite; its sequences are requeued")
        c.save()
        return
    _record(c, rnd, closing.by_name, close_s=c.clock() - closing.started)
    c.state.round = r + 1
    c.state.tokens = closing.tokens_after
    c.state.finished = closing.finishes
    if closing.checkpoint and closing.finishes:
        c.state.checkpoints.append(r + 1)
        c.history.event("checkpoint", None, f"checkpoints/round-{r + 1}")
    c.save()


def _failed(c: Coordinator, rnd: OpenRound, err: Exception) -> NoReturn:
    """(lock held) Re-raise a failed close: an error writing the run directory becomes
    RunDirectoryUnavailable (said once per distinct error), anything else as it is."""
    cause = err.__cause__ if isinstance(err, RunDirectoryUnavailable) else err
    if not isinstance(cause, OSError):
        raise err
    why = f"{type(cause).__name__}: {cause.strerror or cause}"
    if why != c._write_failure:
        c._write_failure = why
        log.error("round %d could not be written to %s (%s); it stays open and closes "
                  "once the run directory can be written", rnd.index, c.dir, why)
        c.history.event("disk", None, f"round {rnd.index} could not be saved ({why}); "
                        "it closes once the run directory can be written")
    raise RunDirectoryUnavailable(
        f"the coordinator cannot write its run directory ({why}); round {rnd.index} "
        "closes once it can. Retry shortly.") from err


def _undo_disk(c: Coordinator, closing: Closing) -> None:
    """(lock held) Remove what a failed close wrote: its logged update, ledger line and
    checkpoint (none of which needs free space)."""
    try:
        c.log.discard(closing.round)
        c.ledger.rewind(closing.ledger_bytes)
        c.writer.remove_unlisted()
    except OSError as err:  # a restart repairs the disk side from state.json
        log.warning("undoing round %d on disk failed: %s", closing.round, err)


def _record(c: Coordinator, rnd: OpenRound, by_name: Mapping[str, list[SparseResult]], *,
            close_s: float) -> None:
    """(lock held) The completed round in the run's history and tracker, and each member's
    share of it."""
    tokens = sum(a.tokens for a in rnd.assignments.values())
    for client, submission in rnd.submissions.items():
        member = c.membership.members.get(client)
        if member is not None:
            member.last_round = rnd.index
            member.last_round_tokens = rnd.assignments[client].tokens
            member.last_round_share = member.last_round_tokens / tokens if tokens else 0.0
            member.last_round_seconds = submission.received_at - rnd.opened_at
    c.history.loss(rnd)
    c.history.round(rnd, by_name, close_s=close_s)
    log.info("%s", round_line(c.state, c.config.round, rnd))


def _track(c: Coordinator, round_index: int) -> None:
    """(lock held) The round's record and losses to the run's tracker ([tracking]). A
    tracker that fails is said once and dropped: the rounds go on without it."""
    record = c.state.rounds[-1]
    scalars = {f"round/{key}": float(record[key]) for key in TRACKED}
    scalars |= {f"loss/tier_{tier}": points[-1][1] for tier, points in c.state.loss.items()
                if points and points[-1][0] == round_index}
    try:
        if c.tracker is None:
            tracking = c.config.tracking
            c.tracker = open_tracker(tracking.kind, c.dir / "tensorboard",
                                     project=tracking.project, name=c.config.run.id,
                                     config={"run": c.config.run.id})
        c.tracker.log(round_index + 1, scalars)
        c.tracker.flush()
    except Exception as err:
        log.warning("[tracking] %s failed (%s); going on without it",
                    c.config.tracking.kind, err)
        c.tracker = NoTracker()
