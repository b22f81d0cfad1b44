"""``held_out.jsonl``: the held-out loss of a run's checkpoints, per tier, as whoever
evaluated them found it (the testnet's report, as each evaluation ends). The coordinator
never evaluates; its status API serves what the file holds, so the dashboard draws the
held-out points beside the training loss while the run, or the report after it, goes on.

    log = HeldOutLog(run_dir)
    log.record(150, {0: 3.21, 1: 3.40}, sequences=128)   # checkpoint round-150, appended
    log.points()       # {"0": [(0, 5.1), (150, 3.21)], ...}: by round, the newest figure

A checkpoint ``round-N`` holds the weights after N rounds, the ones round N starts from, so
its point sits at round N, beside the training loss round N reports. A checkpoint evaluated
again replaces its earlier figures. One JSON line per evaluation, appended; a torn last line
(a writer killed mid-write) and lines that are not a record are skipped.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

HELD_OUT_NAME = "held_out.jsonl"


class HeldOutLog:
    def __init__(self, run_dir: Path) -> None:
        self.path = Path(run_dir) / HELD_OUT_NAME
        self._read: tuple[tuple[int, int], dict[str, list[tuple[int, float, int]]]] | None = None

    def record(self, round_index: int, losses: dict[int, float], *, sequences: int) -> None:
        """Append the held-out loss of checkpoint ``round-<round_index>`` at each tier."""
        line = json.dumps({"round": int(round_index), "sequences": int(sequences),
                           "time": time.time(),
                           "losses": {str(t): float(v) for t, v in sorted(losses.items())}})
        with self.path.open("a") as handle:
            handle.write(line + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def points(self) -> dict[str, list[tuple[int, float, int]]]:
        """tier → [(round, loss, sequences)] by round; read again only when the file
        changed (the API asks once a second per page)."""
        try:
            stat = self.path.stat()
        except FileNotFoundError:
            return {}
        key = (stat.st_mtime_ns, stat.st_size)
        if self._read is None or self._read[0] != key:
            self._read = (key, _points(self.path.read_text(errors="replace")))
        return self._read[1]


def _points(text: str) -> dict[str, list[tuple[int, float, int]]]:
    latest: dict[str, dict[int, tuple[float, int]]] = {}
    for line in text.splitlines():
        record = _record(line)
        if record is None:
            continue
        round_index, sequences, losses = record
        for tier, loss in losses.items():
            latest.setdefault(tier, {})[round_index] = (loss, sequences)
    return {tier: [(r, loss, n) for r, (loss, n) in sorted(by_round.items())]
            for tier, by_round in sorted(latest.items(), key=lambda kv: int(kv[0]))}


def _record(line: str) -> tuple[int, int, dict[str, float]] | None:
    try:
        entry: Any = json.loads(line)
        round_index, sequences = int(entry["round"]), int(entry["sequences"])
        losses = {str(int(t)): float(v) for t, v in entry["losses"].items()}
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    if round_index < 0 or sequences < 1 or not all(map(math.isfinite, losses.values())):
        return None
    return round_index, sequences, losses
