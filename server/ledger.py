"""``trained.jsonl``: which sequences each completed round trained, and the audit that proves
every sequence handed out is trained exactly once (docs/architecture.md, "Members that fail
or misbehave").

    ledger = TrainedLedger(run_dir)
    ledger.record(round_index, sequence_ids)   # in the round's close, before state.json
    ledger.truncate(state.round)               # on resume: drop rounds state.json lacks
    audit = audit_run(config)                  # from the run directory alone, server stopped

One JSON line per completed round, appended and fsynced before ``state.json`` records the
round. A crash between the two leaves a line (possibly torn) for a round that will run
again; ``truncate`` removes it on resume, so the ledger always matches ``state.json``.

The audit's invariant: a training id of the run's order (``modeling.run_order.RunOrder``,
as ``server.work.work_order`` gives it) is handed out fresh once per epoch (the work queue's
``position`` says how many epochs reached it), and a held-out id never. Each hand-out ends
either trained in exactly one completed round or back in the queue's ``requeued`` list,
waiting. So for every id, ``trained + waiting == handed out``; more is a duplicate, less is a
lost sequence, and a held-out id trained is named as such.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from matformer.modeling.atomic import built_aside
from matformer.modeling.run_order import RunOrder

LEDGER_NAME = "trained.jsonl"


class TrainedLedger:
    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / LEDGER_NAME

    def record(self, round_index: int, sequence_ids: Iterable[int]) -> None:
        line = json.dumps({"round": round_index, "ids": [int(i) for i in sequence_ids]})
        with self.path.open("a") as handle:
            handle.write(line + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def size(self) -> int:
        """The ledger's length in bytes, to ``rewind`` to."""
        return self.path.stat().st_size if self.path.is_file() else 0

    def rewind(self, size: int) -> None:
        """Cut the ledger back to ``size`` bytes (what ``size`` said before a close that
        could not be completed); needs no free space."""
        if self.path.is_file() and self.path.stat().st_size > size:
            os.truncate(self.path, size)

    def rounds(self) -> list[dict[str, Any]]:
        """Every complete line, in order; a torn last line (a crash mid-write) is skipped."""
        if not self.path.is_file():
            return []
        entries = []
        for line in self.path.read_text().splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return entries

    def truncate(self, completed_rounds: int) -> None:
        """Keep only rounds ``< completed_rounds`` (atomically, when anything goes)."""
        if not self.path.is_file():
            return
        text = self.path.read_text()
        entries = self.rounds()
        kept = [e for e in entries if e["round"] < completed_rounds]
        if len(kept) == len(entries) and (not text or text.endswith("\n")):
            return  # nothing to drop, no torn line
        with built_aside(self.path) as staging, staging.open("w") as handle:
            handle.writelines(json.dumps(e) + "\n" for e in kept)


@dataclass(kw_only=True)
class LedgerAudit:
    sequences: int  # training ids in the run's order (an epoch)
    rounds: int  # completed rounds in the ledger
    handed_out: int  # fresh hand-outs over all passes
    trained: int  # sequence trainings recorded
    waiting: int  # handed out, back in the queue, not trained yet
    passes_complete: int  # whole passes over the order handed out
    lost: list[int] = field(default_factory=list)  # ids handed out but neither trained nor waiting
    duplicated: list[int] = field(default_factory=list)  # ids trained more often than handed out
    repeated_rounds: list[int] = field(default_factory=list)  # rounds recorded twice
    held_out_trained: list[int] = field(default_factory=list)  # held-out ids a round trained

    @property
    def exactly_once(self) -> bool:
        return not (self.lost or self.duplicated or self.repeated_rounds
                    or self.held_out_trained)

    def summary(self) -> str:
        verdict = "every sequence trained exactly once per pass" if self.exactly_once else (
            f"{len(self.lost)} lost, {len(self.duplicated)} trained twice, "
            f"{len(self.held_out_trained)} held out but trained, rounds recorded twice: "
            f"{self.repeated_rounds[:5]}")
        return (f"{self.rounds} rounds, {self.trained} sequence trainings over "
                f"{self.passes_complete} complete pass(es) of {self.sequences} sequences, "
                f"{self.waiting} waiting in the queue: {verdict}")


def audit(order: RunOrder | Sequence[int] | np.ndarray, queue: dict[str, Any],
          entries: Sequence[dict[str, Any]]) -> LedgerAudit:
    """Check ``trained + waiting == handed out`` for every id of the run's ``order`` (ids
    alone: the same order every epoch), given the work queue's saved state and the ledger's
    entries."""
    if not isinstance(order, RunOrder):
        order = RunOrder.fixed(order)
    n = len(order.training)
    position = int(queue.get("position", 0))
    passes = position // n
    handed = order.handed_out(position)
    waiting = Counter(int(i) for i in queue.get("requeued", []))
    trained: Counter[int] = Counter()
    seen_rounds: Counter[int] = Counter()
    for entry in entries:
        seen_rounds[entry["round"]] += 1
        trained.update(int(i) for i in entry["ids"])
    lost = sorted(i for i in handed if trained[i] + waiting[i] < handed[i])
    duplicated = sorted(i for i in set(trained) | set(waiting)
                        if trained[i] + waiting[i] > handed[i])
    return LedgerAudit(sequences=n, rounds=len(entries), handed_out=position,
                       trained=sum(trained.values()), waiting=sum(waiting.values()),
                       passes_complete=passes, lost=lost, duplicated=duplicated,
                       repeated_rounds=sorted(r for r, k in seen_rounds.items() if k > 1),
                       held_out_trained=sorted(set(map(int, order.held_out)) & set(trained)))


def audit_run(config: Any) -> LedgerAudit:
    """The audit of ``config``'s run directory (a ``RunConfig``), from state.json, the ledger
    and the run's order (``server.work.work_order``)."""
    from matformer.modeling.mdat import Mdat
    from matformer.server.state import RunState
    from matformer.server.work import work_order

    state = RunState.load(Path(config.run.dir))
    if state is None:
        raise FileNotFoundError(f"{config.run.dir} holds no state.json; nothing to audit.")
    with Mdat.open(config.data.path) as mdat:
        _, order = work_order(mdat, config, state)
    return audit(order, state.queue, TrainedLedger(Path(config.run.dir)).rounds())
