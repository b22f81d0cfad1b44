"""The update log: every round's aggregated update since the latest checkpoint (DESIGN.md §6).

``updates/round-<r>.safetensors`` holds, per canonical name, the aggregate's values and
token coverage over the universal shape (``values/<name>``, ``tokens/<name>``; under the
``sign`` rule, which reads nothing else, int8 signs and a 0/1 coverage); beside it
``round-<r>.json`` holds what applying it needs and what it produced: rule, lr, weight
decay, the weight hash per tier after it, the tokens behind each parameter. Applying the
logged rounds in order to the checkpoint they follow gives the master weights bit for bit,
which is how a coordinator resumes and a late joiner catches up. Both files are written
through a temporary name and renamed, the tensors first: a round is logged once its json is.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from modeling.checkpoint.files import read_json, write_json_atomic
from modeling.compression import Aggregate, UpdateConfig


@dataclass(frozen=True, slots=True)
class LoggedUpdate:
    round: int
    update: UpdateConfig  # rule, lr and weight decay it was applied with
    aggregates: dict[str, Aggregate]  # canonical name → values and coverage (universal shape)
    hashes: dict[int, str]  # tier → weight hash of the master after this update
    coverage_tokens: dict[str, int]  # canonical name → Σ tokens of the results behind it

    def apply(self, state: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``state`` (canonical names) after this update; names it does not touch unchanged."""
        rule = self.update.build()
        return {name: rule.apply(weight, self.aggregates[name]) if name in self.aggregates
                else weight for name, weight in state.items()}


class UpdateLog:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _paths(self, round_index: int) -> tuple[Path, Path]:
        stem = self.directory / f"round-{round_index}"
        return stem.with_suffix(".safetensors"), stem.with_suffix(".json")

    def append(self, entry: LoggedUpdate) -> None:
        tensors_path, json_path = self._paths(entry.round)
        tensors = {}
        signs_only = entry.update.rule == "sign"  # the rule reads signs and coverage only
        for name, agg in entry.aggregates.items():
            values, tokens = agg.values, agg.tokens
            if signs_only:
                values, tokens = values.sign().to(torch.int8), agg.covered.to(torch.uint8)
            tensors[f"values/{name}"] = values.contiguous()
            tensors[f"tokens/{name}"] = tokens.contiguous()
        staging = tensors_path.with_name(f".{tensors_path.name}.tmp-{uuid.uuid4().hex[:8]}")
        save_file(tensors, str(staging))
        with staging.open("rb") as handle:
            os.fsync(handle.fileno())
        staging.replace(tensors_path)
        write_json_atomic(json_path, {
            "round": entry.round, "rule": entry.update.rule, "lr": entry.update.lr,
            "weight_decay": entry.update.weight_decay,
            "hashes": {str(t): h for t, h in entry.hashes.items()},
            "coverage_tokens": entry.coverage_tokens,
        })

    def read(self, round_index: int) -> LoggedUpdate:
        tensors_path, json_path = self._paths(round_index)
        meta = read_json(json_path)
        tensors = load_file(str(tensors_path))
        names = [key.partition("/")[2] for key in tensors if key.startswith("values/")]
        return LoggedUpdate(
            round=meta["round"],
            update=UpdateConfig(rule=meta["rule"], lr=meta["lr"],
                                weight_decay=meta["weight_decay"]),
            aggregates={n: Aggregate(values=tensors[f"values/{n}"].float(),
                                     tokens=tensors[f"tokens/{n}"].float()) for n in names},
            hashes={int(t): h for t, h in meta["hashes"].items()},
            coverage_tokens=meta["coverage_tokens"],
        )

    def discard(self, round_index: int) -> None:
        """Forget round ``round_index`` (a close that could not be completed)."""
        for path in self._paths(round_index):
            path.unlink(missing_ok=True)

    def prune(self, through: int) -> None:
        """Drop the rounds up to ``through`` (they are inside a checkpoint now)."""
        for path in self.directory.glob("round-*"):
            if int(path.name.split(".")[0].removeprefix("round-")) <= through:
                path.unlink()
