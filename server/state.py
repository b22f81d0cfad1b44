"""``state.json``: what a coordinator needs, besides checkpoints and the update log, to resume
a run exactly (docs/architecture.md, "The run directory"). Written atomically (temp file,
fsync, rename) after every round and every change of members; the round open at that moment
is not in it (its ids are still in the queue), so a restart opens that round again. Readable
by its owner only (mode 0600, its temp file too): it names the members, and their session
tokens' hashes.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matformer.modeling.atomic import write_json_atomic
from matformer.server.errors import ResumeError

STATE_NAME = "state.json"


@dataclass(kw_only=True, slots=True)
class RunState:
    run_id: str
    data_fingerprint: str  # the MDAT view the sequence ids refer to; checked on resume
    sequences: int | None = None  # ids in the work order (None: saved before it was recorded)
    held_out: int | None = None  # of them held out (None: saved before runs held out a tail)
    round: int = 0  # rounds completed; the next round's index
    tokens: int = 0  # tokens trained on in completed rounds
    queue: dict[str, Any] = field(default_factory=dict)  # WorkQueue.to_dict()
    membership: dict[str, Any] = field(default_factory=dict)  # Membership.to_dict()
    loss: dict[str, list[list[float]]] = field(default_factory=dict)  # tier → [[round, loss]]
    checkpoints: list[int] = field(default_factory=list)  # rounds with a checkpoint, ascending
    finished: bool = False
    events: list[dict[str, Any]] = field(default_factory=list)  # Coordinator._event, oldest first
    rounds: list[dict[str, Any]] = field(default_factory=list)  # Coordinator._record_round
    departed: list[dict[str, Any]] = field(default_factory=list)  # members that left, and why
    departed_beyond: int = 0  # members that left, beyond the newest that ``departed`` keeps

    def snapshot(self) -> RunState:
        """A copy to ``restore`` from: its record lists copied shallowly (a record is never
        changed once written)."""
        return dataclasses.replace(
            self, loss={k: list(v) for k, v in self.loss.items()}, rounds=list(self.rounds),
            events=list(self.events), checkpoints=list(self.checkpoints),
            departed=list(self.departed))

    def restore(self, snapshot: RunState) -> None:
        """Every field back as ``snapshot`` holds it (this object stays the one others hold)."""
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(snapshot, f.name))

    def log_start(self) -> int:
        """The first round the update log keeps: that of the checkpoint before the latest,
        so a client that was one round behind when a checkpoint was written still catches
        up from the log instead of downloading the new checkpoint."""
        return self.checkpoints[-2 if len(self.checkpoints) > 1 else -1]

    def save(self, run_dir: Path) -> None:
        """Write state.json (ValueError for a number that is not finite: never saved)."""
        # every field holds plain JSON data already: no deep copy (``asdict``'s was a
        # third of a save at 64 members)
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        write_json_atomic(Path(run_dir) / STATE_NAME, fields, mode=0o600, compact=True)

    @classmethod
    def load(cls, run_dir: Path) -> RunState | None:
        """The saved state, or None for a run directory without one (a new run).
        ResumeError for a state.json holding NaN or an infinity (written by hand, or by a
        version that let one in): resuming from it would freeze the run again."""
        path = Path(run_dir) / STATE_NAME
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(), parse_constant=_refuse_constant)
        except ValueError as err:
            raise ResumeError(f"{path} is not valid state ({err}); restore it from a backup, "
                              "or start a new run directory.") from err
        state = cls(**data)
        for seq, event in enumerate(state.events):  # numbered since the status API pages them
            event.setdefault("seq", seq)
        for record in state.departed:  # counted since a member's leaves are folded into one
            record.setdefault("leaves", 1)
        return state


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"it holds {name}, which is not a number a run can resume from")
