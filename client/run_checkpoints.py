"""A standalone run's checkpoints: what ``--resume`` needs to go on as if never stopped.

    OUT/checkpoints/step-400/   config.json, model.safetensors, the tokenizer (a loadable
                                checkpoint), training_state.{json,safetensors} (optimizer
                                and schedule, the next step, the history so far, the RNG and
                                fp16 scale)

They sit in the run's folder ``OUT``, beside its final model, so a checkpoint knows its run:
``--resume`` goes on into that folder, and refuses another ``--out`` (which would replace
another run's model). Checkpoints of runs from before they moved in (``OUT.checkpoints/``)
resume into ``OUT`` too.

Each folder is built aside and moved into place whole, so a kill mid-save leaves the
previous checkpoints as they were. The data needs no position of its own: the plan of
batches is a function of the seed, so the next step number says where the data goes on.
A checkpoint records the settings that shape the training; resuming under others is
refused naming them, since the result would match neither run. An FSDP run's checkpoints
hold the whole weights and optimizer state, gathered from the ranks' shards: they resume
under any number of ranks, sharded or not.

A step that does not fit in memory even one sequence a microbatch stops the run, which
first saves what ``--save-every`` would have saved after the step before
(``OutOfMemoryStop``): the steps done are kept for a resume where more memory is free.
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from matformer.modeling.atomic import built_aside
from matformer.modeling.checkpoint import save_pretrained
from matformer.modeling.checkpoint.files import read_weights
from matformer.modeling.checkpoint.pretrained import load_state_into
from matformer.modeling.checkpoint.training_state import load_training_state, save_training_state
from matformer.modeling.devices import Precision
from matformer.modeling.distributed import DataParallel, shard_optimizer_state
from matformer.modeling.errors import BatchDoesNotFit, CheckpointError
from matformer.modeling.optim import LocalOptimizer

DEFAULT_OUT = Path("runs/standalone")
# the options a resumed run must share with the one that saved (what it trains and how)
SHAPING = ("config", "init", "data", "strategy", "view", "seq_len", "batch_tokens", "steps",
           "epochs", "tiers", "tier_mode", "optimizer", "lr", "warmup_steps", "hold_steps",
           "schedule", "final_lr", "weight_decay", "grad_clip", "seed", "batching",
           "precision")
PATHS = ("config", "init", "data")  # of SHAPING, those that name a file or folder
LENGTH = ("steps", "epochs")  # of SHAPING, what a resume may raise: it extends the run


def settings(args: argparse.Namespace) -> dict[str, Any]:
    return {name: str(getattr(args, name)) for name in SHAPING}


def _absolute(saved: dict[str, str]) -> dict[str, str]:
    """Saved settings with their paths absolute, as flags give them now (a checkpoint saved
    before that holds them as typed, relative to the folder the run started in); an ``init``
    that names no folder here is a hub id, kept as it is."""
    return {name: str(Path(value).resolve()) if name in PATHS and value != "None" and
            (name != "init" or Path(value).exists()) else value
            for name, value in saved.items()}


def folder(out: Path) -> Path:
    """Where the run writing its final model to ``out`` keeps its checkpoints."""
    return out / "checkpoints"


def run_folder(out: Path | None, resume: Path | None) -> Path:
    """The run's folder: ``--out``, else the resumed checkpoint's run, else the default.
    Resuming a checkpoint into another run's folder is refused."""
    if resume is None:
        return DEFAULT_OUT if out is None else out
    resume = resume.resolve()
    if resume.parent.name == "checkpoints":
        own: Path | None = resume.parent.parent
    elif resume.parent.name.endswith(".checkpoints"):
        own = resume.parent.with_name(resume.parent.name.removesuffix(".checkpoints"))
    else:
        own = None
    if own is None:
        if out is None:
            raise CheckpointError(f"--resume {resume}: not in a run's checkpoints/ folder, so "
                                  "its run is unknown; give --out, the folder to go on in.")
        return out
    if out is not None and out.resolve() != own:
        raise CheckpointError(
            f"--resume {resume} is a checkpoint of the run in {own}, which goes on there; "
            f"leave --out out (or give --out {own}) rather than write into {out}.")
    return own


def save(out: Path, step: int, model: torch.nn.Module, optimizer: LocalOptimizer,
         precision: Precision, trainer: dict[str, Any], keep_last: int,
         sharded: DataParallel | None = None,
         files: Mapping[str, bytes] | None = None) -> Path | None:
    """``OUT/checkpoints/step-STEP`` (``step``: steps done) with ``files`` beside the weights
    (the tokenizer's), then only the ``keep_last`` newest kept. With ``sharded`` (an FSDP
    run) every rank calls it: the weights and the optimizer state are gathered whole, so the
    checkpoint is the same whatever the number of ranks, and rank 0 writes it."""
    weights, state = None, optimizer.state_dict()
    if sharded is not None:
        weights, state = sharded.full_state(model), sharded.gather_tensors(state)
        if not sharded.leader:
            return None
    target = folder(out) / f"step-{step}"
    with built_aside(target) as building:
        building.mkdir(parents=True)
        save_pretrained(model, building, state=weights, files=files)
        save_training_state(building, {
            "optimizer": state, "rng": torch.get_rng_state(),
            "loss_scale": _scale_of(precision), "trainer": {**trainer, "step": step}})
    for old in sorted(_steps(folder(out)), key=_number)[:-keep_last]:
        shutil.rmtree(old)
    return target


class OutOfMemoryStop(BatchDoesNotFit):
    """Step ``step`` (0-based) of ``total`` ran out of memory at the smallest microbatch;
    ``checkpoint``: the run as it was before it, saved, if this process could save it."""

    def __init__(self, step: int, total: int, args: argparse.Namespace,
                 checkpoint: Path | None) -> None:
        saved = (f"the run as it was after step {step} is saved in {checkpoint}: go on from "
                 "there with --resume where more memory is free (a larger device, or several "
                 "ranks with --fsdp)" if checkpoint is not None else
                 "no checkpoint was saved (rank 0 saves one; this is another rank)")
        super().__init__(
            f"step {step + 1}/{total} does not fit in memory even one sequence a microbatch; "
            f"lower --seq-len (now {args.seq_len}), train fewer or smaller tiers (--tiers "
            f"{args.tiers}) or a smaller model, or train in bf16 (--precision), each a new "
            f"run; {saved}.")
        self.checkpoint = checkpoint


class Saved:
    """A checkpoint to resume from, checked against this run's settings when opened. Its
    weights go into the whole model before any sharding, its optimizer state after the
    optimizer is built (cut to this rank's shards under FSDP)."""

    def __init__(self, directory: Path, args: argparse.Namespace) -> None:
        try:
            self.state = load_training_state(directory)
        except FileNotFoundError:
            raise CheckpointError(f"--resume {directory}: no training state there; give a "
                                  "step-N folder of OUT/checkpoints/.") from None
        self.directory = directory
        self.trainer: dict[str, Any] = self.state["trainer"]
        now, saved_settings = settings(args), _absolute(self.trainer["settings"])
        self.length = " ".join(f"--{name} {saved_settings[name]}" for name in LENGTH
                               if saved_settings[name] != "None")  # as it was saved
        self.extended = any(now[name] != saved_settings[name] for name in LENGTH)
        differ = [f"--{name.replace('_', '-')} {saved!r} (now {now[name]!r})"
                  for name, saved in saved_settings.items()
                  if now[name] != saved and name not in LENGTH]
        if differ:
            listing = ", ".join(differ)
            raise CheckpointError(f"--resume {directory}: it was saved with {listing}; resume "
                                  "with the same settings, or start a new run.")

    def load_weights(self, model: torch.nn.Module) -> None:
        load_state_into(model, read_weights(self.directory), self.directory)

    def load_optimizer(self, optimizer: LocalOptimizer, precision: Precision) -> None:
        """The optimizer and schedule, the RNG and the fp16 loss scale as they were saved."""
        saved = self.state["optimizer"]
        if len(saved["optimizers"]) == len(optimizer.optimizers):  # else load_state_dict says
            saved = {**saved, "optimizers": [
                shard_optimizer_state(opt, whole)
                for opt, whole in zip(optimizer.optimizers, saved["optimizers"], strict=True)]}
        optimizer.load_state_dict(saved)
        torch.set_rng_state(self.state["rng"])
        if precision.loss_scale is not None:
            precision.loss_scale.scale, precision.loss_scale.clean_steps = \
                self.state["loss_scale"]


def set_aside_later(out: Path, step: int) -> tuple[Path, list[str]] | None:
    """A run resumed at ``step`` replaces the one that went past it: that run's checkpoints
    after ``step`` move into ``checkpoints/replaced-after-step-STEP`` (``-2``, ``-3`` on a
    later resume from the same step), so that they are neither overwritten nor pruned as
    this run's own. The folder and what moved into it; None when nothing was past ``step``."""
    later = sorted((p for p in _steps(folder(out)) if _number(p) > step), key=_number)
    if not later:
        return None
    aside, count = folder(out) / f"replaced-after-step-{step}", 1
    while aside.exists():
        count += 1
        aside = folder(out) / f"replaced-after-step-{step}-{count}"
    aside.mkdir()
    for path in later:
        path.rename(aside / path.name)
    return aside, [p.name for p in later]


def latest(out: Path) -> Path | None:
    """The newest checkpoint of the run writing to ``out``, if it wrote one."""
    steps = _steps(folder(out)) if folder(out).is_dir() else []
    return max(steps, key=_number) if steps else None


def _scale_of(precision: Precision) -> list[float] | None:
    scale = precision.loss_scale
    return None if scale is None else [scale.scale, scale.clean_steps]


def _steps(folder: Path) -> list[Path]:
    return [p for p in folder.glob("step-*") if p.is_dir() and p.name[5:].isdigit()]


def _number(path: Path) -> int:
    return int(path.name[5:])
