"""The update log: every round's update since the latest checkpoint (docs/architecture.md).

Each round is the ``RoundUpdate`` record every side shares, in its compact form:
``updates/round-<r>.safetensors`` holds each step's tensors (``values/<name>`` for an exact
step; ``positions/<name>`` packed to their bits, ``levels/<name>`` and ``scales/<name>`` for
a compressed one) and ``round-<r>.json`` the rest: rule, lr, weight decay, the weight hash
per tier after it, the tokens behind each parameter, and each step's shape, boxes and chunk.
Applying the logged rounds in order to the checkpoint they follow gives the master weights
bit for bit, which is how a coordinator resumes and a late joiner catches up. Both files are
written through a temporary name and renamed, the tensors first: a round is logged once its
json is.

A run whose update carries state from round to round (a compressed broadcast's residual,
an outer momentum) also logs each round's inputs, ``round-<r>.inputs.safetensors`` with
their fields in the json (``server/outer_state.py``): a resume closes those rounds again to
rebuild that state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from matformer.modeling.atomic import built_aside, write_json_atomic
from matformer.modeling.checkpoint.files import read_json
from matformer.modeling.compression import (
    ChunkGrid,
    CoefficientStep,
    DenseStep,
    RoundUpdate,
    SparseResult,
    Step,
    UpdateConfig,
    pack_bits,
    position_bits,
    unpack_bits,
)
from matformer.server.outer_state import results_from, results_record


class UpdateLog:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    def _paths(self, round_index: int) -> tuple[Path, Path, Path]:
        """(steps' tensors, json, inputs' tensors) of a round."""
        stem = self.directory / f"round-{round_index}"
        return (stem.with_suffix(".safetensors"), stem.with_suffix(".json"),
                stem.with_suffix(".inputs.safetensors"))

    def write_inputs(self, round_index: int,
                     inputs: Mapping[str, Sequence[SparseResult]]) -> dict[str, Any]:
        """Write the results round ``round_index``'s close aggregates (whole or not at all),
        before ``append`` logs the round; returns their fields, which ``append`` records. It
        reads only the results, so it may run beside the close's computation."""
        tensors, meta = results_record(inputs)
        with built_aside(self._paths(round_index)[2]) as staging:
            save_file(tensors, str(staging))
        return meta

    def append(self, entry: RoundUpdate, inputs: Mapping[str, Any] | None = None) -> None:
        """Log ``entry``; ``inputs``: the fields ``write_inputs`` returned, and ``outer``,
        the settings of the close the entry does not hold (vote, momentum)."""
        tensors_path, json_path, _ = self._paths(entry.round)
        tensors, steps = {}, {}
        for name, step in entry.steps.items():
            steps[name] = {"shape": list(step.shape), "covered": step.covered, "box": step.box}
            if isinstance(step, DenseStep):
                tensors[f"values/{name}"] = step.values.contiguous()
                continue
            steps[name]["chunk"] = list(step.chunk)
            packed = pack_bits(step.positions, position_bits(step.grid.chunk_numel))
            tensors[f"positions/{name}"] = torch.frombuffer(bytearray(packed), dtype=torch.uint8)
            tensors[f"levels/{name}"] = step.levels.contiguous()
            tensors[f"scales/{name}"] = step.scales.contiguous()
        with built_aside(tensors_path) as staging:
            save_file(tensors, str(staging))
        update = entry.update
        write_json_atomic(json_path, {
            "round": entry.round, "rule": update.rule, "lr": update.lr,
            "weight_decay": update.weight_decay, "broadcast_topk": update.broadcast_topk,
            "broadcast_bits": update.broadcast_bits,
            "chunk": update.chunk, "hashes": {str(t): h for t, h in entry.hashes.items()},
            "coverage_tokens": entry.coverage_tokens, "steps": steps,
            **(inputs or {}),
        }, compact=True)

    def read(self, round_index: int) -> RoundUpdate:
        tensors_path, json_path, _ = self._paths(round_index)
        meta = read_json(json_path)
        tensors = load_file(str(tensors_path))
        return RoundUpdate(
            round=meta["round"],
            update=UpdateConfig(rule=meta["rule"], lr=meta["lr"],
                                weight_decay=meta["weight_decay"],
                                broadcast_topk=meta["broadcast_topk"], chunk=meta["chunk"],
                                # a record from before broadcast_bits: int8 levels
                                broadcast_bits=meta.get("broadcast_bits", 8)),
            steps={name: _step(name, fields, tensors) for name, fields in meta["steps"].items()},
            hashes={int(t): h for t, h in meta["hashes"].items()},
            coverage_tokens=meta["coverage_tokens"],
        )

    def read_inputs(self, round_index: int
                    ) -> tuple[dict[str, list[SparseResult]], dict[str, Any]] | None:
        """The results round ``round_index``'s close aggregated and its outer settings; None
        when the round logged none (a run that carries nothing, or a round logged before
        inputs were)."""
        _, json_path, inputs_path = self._paths(round_index)
        meta = read_json(json_path)
        if "inputs" not in meta:
            return None
        return results_from(load_file(str(inputs_path)), meta["inputs"]), meta["outer"]

    def discard(self, round_index: int) -> None:
        """Forget round ``round_index`` (a close that could not be completed)."""
        for path in self._paths(round_index):
            path.unlink(missing_ok=True)

    def prune(self, through: int) -> None:
        """Drop the rounds up to ``through`` (they are inside a checkpoint now)."""
        for path in self.directory.glob("round-*"):
            if int(path.name.split(".")[0].removeprefix("round-")) <= through:
                path.unlink()


def _step(name: str, fields: dict[str, Any], tensors: dict[str, torch.Tensor]) -> Step:
    shape = tuple(fields["shape"])
    covered = tuple(tuple(tuple(pair) for pair in box) for box in fields["covered"])
    box = tuple(tuple(pair) for pair in fields["box"])
    if "chunk" not in fields:
        return DenseStep(shape=shape, covered=covered, box=box, values=tensors[f"values/{name}"])
    chunk = tuple(fields["chunk"])
    levels = tensors[f"levels/{name}"]
    bits = position_bits(ChunkGrid(shape=shape, chunk=chunk).chunk_numel)
    positions = unpack_bits(tensors[f"positions/{name}"].numpy().tobytes(), bits, levels.numel())
    return CoefficientStep(shape=shape, covered=covered, box=box, chunk=chunk,
                           positions=positions.reshape(levels.shape), levels=levels,
                           scales=tensors[f"scales/{name}"])
