"""Where a coordinator starts: a new run's first master, or a saved run's master rebuilt from
its latest checkpoint and the logged updates since (docs/architecture.md, "The run
directory"), after what a kill left half-written is cleared away. The coordinator hands it
what a start reads and writes (``Start``), not itself.
"""

from __future__ import annotations

import logging
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from matformer.modeling.checkpoint import load_pretrained
from matformer.modeling.models import build_model
from matformer.modeling.naming import canonical_state_dict
from matformer.modeling.run_order import RunOrder
from matformer.modeling.training import target_tokens
from matformer.server.errors import ResumeError
from matformer.server.membership import Membership
from matformer.server.policies import policy_from_record
from matformer.server.shards import apply_round, close_master, settle
from matformer.server.state import RunState
from matformer.server.update_steps import ARITHMETIC, Carried
from matformer.server.work import WorkQueue

if TYPE_CHECKING:
    from matformer.modeling.config import ModelConfig
    from matformer.modeling.mdat.sequences import SequenceReader
    from matformer.server.checkpoint_writer import CheckpointWriter
    from matformer.server.checkpoints import CheckpointStore
    from matformer.server.config import RunConfig
    from matformer.server.history import RunHistory
    from matformer.server.ledger import TrainedLedger
    from matformer.server.policies import RoundPolicy
    from matformer.server.shards import ShardGroup
    from matformer.server.update_log import UpdateLog

# Names that atomic writes (modeling/atomic.py) give their temporary files and folders
# (".state.json.tmp-1a2b3c4d", ".round-4.old-1a2b3c4d"): what a kill during a write leaves.
TEMP_NAME = re.compile(r"\..+\.(tmp|old)(-[0-9a-f]{8})?")

log = logging.getLogger("matformer.server")


@dataclass(kw_only=True)
class Start:
    """What a coordinator's start reads and writes: the run's config, model and data, the
    stores of its directory, its history and round policy; ``state`` and ``queue`` as the
    coordinator holds them once ``records`` made them, ``save`` writes state.json."""

    config: RunConfig
    model_config: ModelConfig
    reader: SequenceReader
    log: UpdateLog
    ledger: TrainedLedger
    checkpoints: CheckpointStore
    writer: CheckpointWriter
    history: RunHistory
    policy: RoundPolicy
    tied: Callable[[dict[str, Tensor]], dict[str, Tensor]]
    tier_hashes: Callable[[list[int], Mapping[str, Tensor]], dict[int, str]]
    save: Callable[[], None]
    shards: ShardGroup | None  # the close's shards, which read and replay their own parts
    current_state: Callable[[], RunState]
    current_queue: Callable[[], WorkQueue]

    @property
    def dir(self) -> Path:
        return Path(self.config.run.dir)

    @property
    def state(self) -> RunState:
        return self.current_state()

    @property
    def queue(self) -> WorkQueue:
        return self.current_queue()


def records(c: Start, saved: RunState | None, order: RunOrder
            ) -> tuple[RunState, Membership, WorkQueue]:
    """The run's state, members and work queue: as saved, or new."""
    policy = c.config.tiers.build(c.model_config)
    if saved is not None:
        _check_resumable(c, saved, order.candidates)
        return (saved, Membership.from_dict(policy, saved.membership),
                WorkQueue(order, **saved.queue))
    state = RunState(run_id=c.config.run.id, data_fingerprint=c.reader.fingerprint,
                     sequences=order.candidates, held_out=len(order.held_out))
    return state, Membership(policy), WorkQueue(order)


def master(c: Start, saved: RunState | None, initial: Mapping[str, Tensor] | None
           ) -> tuple[Mapping[str, Tensor], Carried]:
    """The master and the carried outer state to go on from, once what a kill left
    half-written is cleared away: a new run's (its checkpoint round-0 written and listed),
    or the saved run's, replayed."""
    _remove_temp_files(c.dir)
    c.writer.remove_unlisted()
    c.ledger.truncate(0 if saved is None else saved.round)
    if saved is not None:
        replayed = _replayed(c)
        c.history.event("resume", None, f"resumed at round {saved.round}")
        if saved.finished:
            _finished_or_extended(c, saved)
        return replayed
    order = c.queue.order
    if order.candidates < len(c.reader):
        c.history.event(
            "data", None, f"left out {len(c.reader) - order.candidates:,} of {len(c.reader):,} "
            f"sequences, of fewer than {target_tokens(c.model_config)} tokens: they carry no "
            "target")
    start = _initial(c, initial)
    c.checkpoints.write(0, start, Carried())
    c.state.checkpoints.append(0)
    c.save()
    return start, Carried()


def _finished_or_extended(c: Start, saved: RunState) -> None:
    """A finished run goes on when [round] now asks for more rounds or tokens than it
    trained (its lr schedule then spans the new length); otherwise it stays finished, and
    says how to extend it."""
    stop = c.config.round
    limits = {name: (limit, done) for name, limit, done in
              (("rounds", stop.rounds, saved.round), ("tokens", stop.tokens, saved.tokens))
              if limit is not None}
    if all(done < limit for limit, done in limits.values()):
        saved.finished = False
        asked = " and ".join(f"{name} = {limit:,}" for name, (limit, _) in limits.items())
        said = (f"the run had finished after {saved.round} rounds; [round] now asks for "
                f"{asked or 'no limit'}: training on")
        log.warning("%s", said)
        c.history.event("extend", None, said)
        c.save()
        return
    log.warning("the run finished after %d rounds (%s tokens); to train on, raise [round] "
                "rounds or tokens past them", saved.round, f"{saved.tokens:,}")


def _check_resumable(c: Start, saved: RunState, sequences: int) -> None:
    """ResumeError unless the saved run reads the data [data] reads now."""
    if saved.data_fingerprint != c.reader.fingerprint:
        raise ResumeError(
            f"{c.dir} was trained on data with fingerprint {saved.data_fingerprint}, "
            f"but [data] now reads {c.reader.fingerprint}; point [data] at the run's "
            "MDAT view, or start a new run directory.")
    if saved.sequences not in (None, sequences):
        raise ResumeError(
            f"{c.dir} hands out {saved.sequences} sequences, but [data] now gives "
            f"{sequences} that carry a target (the [model] changed?); restore the "
            "run's run.toml, or start a new run directory.")


def _remove_temp_files(directory: Path) -> None:
    """The temporary files and folders of atomic writes that a kill interrupted."""
    for path in sorted(directory.rglob(".*"), key=lambda p: len(p.parts), reverse=True):
        if TEMP_NAME.fullmatch(path.name) and path.exists():
            log.warning("removing %s: left by a write interrupted before a restart", path)
            shutil.rmtree(path) if path.is_dir() else path.unlink()


def _initial(c: Start, initial: Mapping[str, Tensor] | None
                   ) -> dict[str, Tensor]:
    """A new run's master: ``initial``, else [model] checkpoint, else a model initialised
    with ``data.seed``."""
    if initial is None:
        model = c.config.model
        if model.checkpoint is not None:
            initial = canonical_state_dict(load_pretrained(
                model.checkpoint_folder(), trust_remote_code=model.trust_remote_code))
        else:
            torch.manual_seed(c.config.data.seed)
            initial = canonical_state_dict(build_model(c.model_config))
    return c.tied({n: t.detach().clone() for n, t in initial.items()})


def _replayed(c: Start) -> tuple[Mapping[str, Tensor], Carried]:
    """The master and carried state of the saved run: the latest checkpoint's, then the
    rounds logged since closed again from their logged inputs (``outer_state.py``), checked
    against the weight hashes the log recorded. A round logged without inputs (before they
    were logged) is applied from its steps, and the carried state begins at zero from there,
    said once; so does a checkpoint saved without outer state."""
    base = c.state.checkpoints[-1]
    folder = c.checkpoints.path(base)
    if not folder.is_dir():
        raise ResumeError(f"state.json names checkpoint {folder}, which is missing; "
                          "restore it, or start a new run directory.")
    update = c.config.update.build(c.state.round, c.config.round.planned_rounds,
                                   c.config.compression)
    broadcast = update.build().broadcast
    carried: Carried | None  # None: not known
    if c.shards is None:
        master: Mapping[str, Tensor] = c.checkpoints.read(base)
        carried = c.checkpoints.read_carried(base, broadcast)
    else:  # each shard reads its own part
        master, found = c.shards.load(folder, broadcast)
        carried = Carried() if found else None
    lost = None if carried is not None else f"checkpoint round-{base} holds no outer state"
    entries = [c.log.read(r) for r in range(base, c.state.round)]
    for entry in entries:
        logged = None if carried is None else c.log.read_inputs(entry.round)
        outer = {} if logged is None else dict(logged[1])
        arithmetic = outer.pop("arithmetic", 1)  # a compressed close's (update_steps.py)
        if logged is not None and entry.update.broadcast_topk and arithmetic != ARITHMETIC:
            lost = f"round {entry.round} was closed by an earlier version's arithmetic"
            logged = None
        if logged is None:
            if carried is not None and lost is None:
                lost = f"round {entry.round} was logged without the results it aggregated"
            master, carried = apply_round(entry, master, c.tied), None
            continue
        master, _, carried, _ = close_master(policy_from_record(outer), entry.update, master,
                                             logged[0], carried, c.tied)
        settle(master, commit=True)
    if entries and c.tier_hashes(list(entries[-1].hashes), master) != entries[-1].hashes:
        raise ResumeError(f"replaying {c.dir / 'updates'} onto checkpoint round-{base} "
                          "does not reproduce the logged weight hashes; the log or the "
                          "checkpoint was altered. Restore them, or start a new run.")
    if lost and c.policy.carries_state(c.config.update.broadcast(c.config.compression)):
        log.warning("%s (written by an earlier version): the outer momentum and the "
                    "broadcast's residual start again from zero, so the run goes on along "
                    "another path than it would have without the restart", lost)
    return master, Carried() if carried is None else carried
