"""[run], [checkpoint] and [tracking]: the run's name, its directory, the checkpoints it
keeps there and where its per-round figures go."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from modeling.tracking import TRACKERS
from server.sections.checks import require, within

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(kw_only=True, slots=True)
class RunSection:
    id: str  # names the run in Join requests, logs and the dashboard
    dir: Path  # run directory: state.json, checkpoints/, updates/ (created on start)

    def __post_init__(self) -> None:
        require(bool(_RUN_ID.fullmatch(self.id)),
                f"[run] id {self.id!r} must be letters, digits, '.', '_' or '-', starting "
                "with a letter or digit; rename it.")


@dataclass(kw_only=True, slots=True)
class CheckpointSection:
    every_rounds: int = 10  # universal + tier slices + manifest after every this many rounds
    # the newest checkpoints kept; older ones are removed once a newer one is complete. At
    # least 2: the update log starts at the one before the latest.
    keep_last: int = 3
    keep_first: bool = True  # also keep the run's first checkpoint (its starting weights)

    def __post_init__(self) -> None:
        require(self.every_rounds >= 1,
                f"[checkpoint] every_rounds must be >= 1, got {self.every_rounds}.")
        within("[checkpoint] keep_last", self.keep_last, 2, 1_000_000)


@dataclass(kw_only=True, slots=True)
class TrackingSection:
    """Where the coordinator's per-round figures go besides state.json."""

    # tensorboard: event files in the run directory's tensorboard/ | trackio | wandb | none
    kind: str = "tensorboard"
    project: str = "matformer"  # trackio's and wandb's project name

    def __post_init__(self) -> None:
        require(self.kind in TRACKERS,
                f"[tracking] kind {self.kind!r} is not one of {', '.join(TRACKERS)}.")
        require(self.kind == "none" or importlib.util.find_spec(self.kind) is not None,
                f"[tracking] kind {self.kind!r} needs the {self.kind} package (pip install "
                f"{self.kind}); or kind = \"none\".")
