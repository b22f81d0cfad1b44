"""[run], [checkpoint] and [tracking]: the run's name, its directory, the checkpoints it
keeps there and where its per-round figures go."""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from matformer.modeling.settings import setting
from matformer.modeling.tracking import TRACKERS
from matformer.server.sections.checks import MAX_COUNT, MAX_SECONDS, SECONDS, require

_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


@dataclass(kw_only=True, slots=True)
class RunSection:
    id: str = setting(help=(
        "names the run in Join requests, logs and the dashboard: letters, digits, '.', '_', '-'"))
    dir: Path = setting(help=(
        "run directory: state.json, checkpoints/, updates/ (created on start)"))

    def __post_init__(self) -> None:
        require(bool(_RUN_ID.fullmatch(self.id)),
                f"[run] id {self.id!r} must be letters, digits, '.', '_' or '-', starting "
                "with a letter or digit; rename it.")


@dataclass(kw_only=True, slots=True)
class CheckpointSection:
    every_rounds: int = setting(10, low=1, high=MAX_COUNT, help=(
        "universal + tier slices + manifest after every this many rounds"))
    # Older checkpoints are removed once a newer one is complete; at least 2 are kept, as the
    # update log starts at the one before the latest.
    keep_last: int = setting(3, low=2, high=1_000_000, help="the newest checkpoints kept")
    keep_first: bool = setting(True, help=(
        "also keep the run's first checkpoint (its starting weights)"))


@dataclass(kw_only=True, slots=True)
class TrackingSection:
    """Where the coordinator's per-round figures go besides state.json."""

    kind: str = setting("tensorboard", choices=TRACKERS, help=(
        "tensorboard: event files in the run directory's tensorboard/; trackio, wandb when "
        "installed; none"))
    project: str = setting("matformer", help="trackio's and wandb's project name")

    def __post_init__(self) -> None:
        require(self.kind == "none" or importlib.util.find_spec(self.kind) is not None,
                f"[tracking] kind {self.kind!r} needs the {self.kind} package (pip install "
                f"{self.kind}); or kind = \"none\".")


@dataclass(kw_only=True, slots=True)
class CoordinatorSection:
    """How the coordinator computes a round's close (server/shards.py)."""

    shards: int = setting(1, low=1, high=64, help=(
        "processes the close is sharded over (torch.distributed, Gloo): each owns a "
        "contiguous part of the parameters, its master, momentum and residual, and closes it; "
        "1 closes in the coordinator's process"))
    shard_host: str = setting("", help=(
        "empty: the coordinator starts its shards on its own machine; an address: it listens "
        "there and waits for shards started elsewhere (matformer shard --coordinator "
        "HOST:PORT --rank R --count N, on machines sharing the run directory)"))
    shard_port: int = setting(29400, low=1, high=65535, help=(
        "with shard_host: the port the shards join at"))
    shard_wait_s: float = setting(600.0, low=1, high=MAX_SECONDS, unit=SECONDS, help=(
        "with shard_host: how long the coordinator waits for its shards to join"))

