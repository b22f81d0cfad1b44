"""Where a run's figures go as it trains: TensorBoard event files by default, trackio or
Weights & Biases when installed and asked for (``--track``; run.toml's ``[tracking]``).

    tracker = open_tracker("tensorboard", Path("runs/standalone.tensorboard"), config={...})
    tracker.log(step, {"loss/tier_0": 3.1, "lr": 3e-3})
    tracker.close()

Standalone training's tags: ``loss/tier_<label>`` per trained tier, ``lr``,
``tokens_per_second``, ``grad_norm`` (before clipping), and ``held_out/tier_<label>`` at the
start and the end. A coordinator's, per round: ``loss/tier_<tier>`` (the token-weighted mean
its clients reported), ``round/duration_s``, ``round/slowest_s``, ``round/tokens``,
``round/clients``, ``round/bytes_sent`` and ``round/bytes_dense``.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any, Protocol

from matformer.modeling.errors import ConfigError
from matformer.modeling.event_file import EventFile

TRACKERS = ("tensorboard", "trackio", "wandb", "none")


class Tracker(Protocol):
    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def flush(self) -> None: ...  # what was logged reaches its destination now

    def close(self) -> None: ...


class NoTracker:
    def log(self, step: int, scalars: dict[str, float]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardTracker:
    """Event files that ``tensorboard --logdir`` reads, written by ``modeling.event_file``
    (TensorBoard itself is needed only to look at them)."""

    def __init__(self, directory: Path) -> None:
        self.events = EventFile(directory)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.events.add_scalars(step, scalars)

    def flush(self) -> None:
        self.events.flush()

    def close(self) -> None:
        self.events.close()


class RunLogger:
    """trackio and wandb share one API: ``init(project, config)``, ``log(dict, step)``,
    ``finish()``."""

    def __init__(self, module: Any, project: str, name: str, config: dict[str, Any]) -> None:
        self.module = module
        module.init(project=project, name=name, config=config)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        self.module.log(scalars, step=step)

    def flush(self) -> None:
        pass  # both send in the background as they go

    def close(self) -> None:
        self.module.finish()


def open_tracker(kind: str, directory: Path, *, project: str, name: str,
                 config: dict[str, Any]) -> Tracker:
    """``kind``'s tracker: event files in ``directory``, or the run ``name`` of trackio's or
    W&B's ``project`` (trackio keeps it in a local database; W&B offline too under
    ``WANDB_MODE=offline``)."""
    if kind == "none":
        return NoTracker()
    if kind == "tensorboard":
        return TensorBoardTracker(directory)
    if kind in ("trackio", "wandb"):
        if importlib.util.find_spec(kind) is None:
            raise ConfigError(f"--track {kind} needs the {kind} package (pip install {kind}); "
                              "--track tensorboard needs nothing more.")
        return RunLogger(importlib.import_module(kind), project, name, config)
    raise ConfigError(f"--track {kind!r} is not one of {', '.join(TRACKERS)}.")
