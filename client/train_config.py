"""`matformer-train --config train.toml`: a whole training run in one file, its keys declared
once below (`modeling.settings`). From each section's declaration come the checks of the file,
``train_schema()``, and the flags of ``matformer-train``: a key's flag is ``--key-name``
(``[data] path`` is ``--data``), and it sets ``args.key_name`` (``args.data``).

A run's settings are the defaults, then the file's keys, then ``--set SECTION.KEY=VALUE``,
then the flags given, checked once per section. A path in the file is relative to its folder,
a flag's to the working directory. ``examples/train.toml`` shows every key with its default.
A ``--config`` JSON in seed 000's layout (``model_config``, ``training``, ``tokenizer``,
``data``) is read onto the same keys by `client.seed_config` (``--set`` takes its dotted keys
there: ``training.lr=0.001``); any other ``--config`` that is not a ``.toml`` file is
``[model] config``.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import Field, dataclass, fields
from pathlib import Path
from typing import Any

from matformer.client import seed_config
from matformer.client.epochs import DEFAULT_STEPS
from matformer.client.run_checkpoints import DEFAULT_OUT
from matformer.modeling.commands import apply_overrides
from matformer.modeling.config import ModelConfig
from matformer.modeling.devices import PRECISIONS
from matformer.modeling.errors import ConfigError, InvalidValue, UnknownKey, WrongType, did_you_mean
from matformer.modeling.mdat import DEFAULT_DATA, DEFAULT_STRATEGY
from matformer.modeling.optim import OPTIMIZER_NAMES, SCHEDULES
from matformer.modeling.settings import (
    FolderOrRepo,
    flag_of,
    given_flags,
    json_schema,
    read_table,
    read_toml,
    reject_unknown,
    setting,
)
from matformer.modeling.tracking import TRACKERS

TIERS = re.compile(r"\s*\d+\s*(,\s*\d+\s*)*")  # "0,1,2", as --tiers takes them


@dataclass(kw_only=True, slots=True)
class ModelSection:
    """The model: a config JSON, a checkpoint to finetune, or (without these keys)
    ModelConfig's fields inline; none of them: a tiny model."""

    config: Path | None = setting(None, flag="--config", help=(
        "a model config JSON; on the command line also a train.toml or a seed config JSON, "
        "whose keys then set the run (examples/train.toml)"))
    init: FolderOrRepo | None = setting(None, help=(
        "start from this checkpoint's weights and architecture (a Matformer or Hugging Face "
        "Llama folder, or a hub repo id in the cache), with this run's optimizer settings: "
        "finetuning"))


@dataclass(kw_only=True, slots=True)
class DataSection:
    """What the run trains on: the sequences of an MDAT container."""

    path: Path | None = setting(None, flag="--data", help=(
        f"an MDAT container (without it {DEFAULT_DATA}, built from the stdlib docstrings on "
        "first use)"))
    documents: int | None = setting(None, low=1, help="docstrings in the default container (all)")
    strategy: str = setting(DEFAULT_STRATEGY["strategy_name"], help="the container's strategy")
    view: str | None = setting(None, help="a view of the container (without it, all of it)")
    saetta: Path | None = setting(None, help=(
        "a saetta export of that view (matformer mdat export-saetta, with this run's strategy, "
        "seq_len and seed): the same sequences in the same order, read front to back"))
    seq_len: int = setting(256, low=1, help="max_seq_len, a multiple of the strategy's chunk_size")
    batching: str = setting("packed", choices=("packed", "padded"), help=(
        "packed: sequences end to end in rows of seq_len tokens; padded: one sequence a row"))
    num_workers: int = setting(0, low=0, help=(
        "threads that read the next steps' sequences and rows while a step trains, "
        "a few steps ahead (0: read in the training loop); the same batches either way"))


@dataclass(kw_only=True, slots=True)
class TrainingSection:
    """How it trains: the run's length, the optimizer and its schedule, batches and tiers."""

    steps: int | None = setting(None, low=1, help=f"optimizer steps (without it {DEFAULT_STEPS})")
    epochs: int | None = setting(None, low=1, help="passes over the data, each in a fresh order")
    optimizer: str = setting("adamw", choices=OPTIMIZER_NAMES, help="the local optimizer")
    lr: float = setting(3e-3, low=0, above=True, help="peak learning rate")
    final_lr: float | None = setting(None, low=0, help="where the decay ends (without it, lr / 10)")
    warmup_steps: int | None = setting(None, low=0, help="linear warmup (without it, 20 at most)")
    hold_steps: int = setting(0, low=0, help="steps at the peak lr after warmup, before the decay")
    schedule: str = setting("cosine", choices=SCHEDULES, help="the decay after warmup and hold")
    weight_decay: float = setting(0.01, low=0, help="decoupled (AdamW), on matrices only")
    grad_clip: float = setting(1.0, low=0, help="clip the gradient's norm to this (0: no clipping)")
    batch_tokens: int = setting(1024, low=1, help="padded tokens per optimizer step")
    microbatch_tokens: int = setting(512, low=1, help="tokens a forward/backward (shrinks on OOM)")
    microbatch_examples: int = setting(64, low=1, help="rows a forward/backward (shrinks on OOM)")
    pad_to_multiple_of: int = setting(1, low=1, high=4096, help=(
        "pad each row to a multiple of this many tokens (8 or 64: shapes GPU tensor cores take "
        "whole; budgets count the padding; 1: to the longest row only)"))
    eval_microbatch_tokens: int | None = setting(None, low=1, help=(
        "padded tokens a forward pass of the held-out evaluation, at most microbatch_tokens "
        "(without it, microbatch_tokens)"))
    tiers: str = setting("0,1,2", help="comma-separated tiers to train (a list in TOML too)")
    tier_mode: str = setting("all", choices=("all", "sample"), help=(
        "all: every tier each step (summed losses); sample: one a step"))
    tier_mixes: int = setting(0, low=0, help=(
        "per-layer mixes of the tiers drawn each step besides them, widths never growing "
        "with depth: Mix'n'Match slices trained too (matformer slice); 0: none"))
    seed: int = setting(0, low=0, help="of the shuffle, the epochs' orders, masks and tier draws")
    save_every: int = setting(0, low=0, help="write OUT/checkpoints/step-N every N steps (0: none)")
    keep_last: int = setting(2, low=1, help="how many of those checkpoints to keep")

    def __post_init__(self) -> None:
        if not TIERS.fullmatch(self.tiers):
            raise InvalidValue(f"[training] tiers must be tier numbers such as \"0,1,2\" or "
                               f"[0, 1, 2], got {self.tiers!r}.")
        if (self.eval_microbatch_tokens or 0) > self.microbatch_tokens:
            raise InvalidValue(
                f"[training] eval_microbatch_tokens {self.eval_microbatch_tokens} is above "
                f"microbatch_tokens {self.microbatch_tokens}: evaluation's microbatches are "
                "never larger than training's; lower it, or leave it out to use "
                "microbatch_tokens.")


@dataclass(kw_only=True, slots=True)
class HardwareSection:
    """Where it runs (also under torchrun: data parallel)."""

    device: str = setting("cpu", help=(
        "cpu | cuda | cuda:N | mps; a device this machine lacks is an error. Under torchrun, "
        "cuda means each rank's local GPU"))
    precision: str = setting("fp32", choices=PRECISIONS, help="fp32, or autocast, float32 weights")
    compile: bool = setting(False, help="torch.compile the model (needs a C++ compiler on CPU)")
    fsdp: bool = setting(False, help=(
        "under torchrun: shard weights, gradients and optimizer state over the ranks (FSDP2), "
        "for a model one device cannot hold"))
    threads: int | None = setting(None, low=1, help=(
        "CPU threads torch computes with; unset: the cores idle at the start (measured), "
        "shared among torchrun's ranks, at least 1"))


@dataclass(kw_only=True, slots=True)
class LoggingSection:
    """What it shows and where it writes."""

    track: str = setting("tensorboard", choices=TRACKERS, help=(
        "where the figures go as it trains: TensorBoard event files in OUT/tensorboard/, "
        "trackio, wandb, or none"))
    project: str = setting("matformer", help="trackio's or W&B's project (the run: out's name)")
    log_every: int = setting(20, low=1, help="print the losses every this many steps")
    log_longest_every: int = setting(0, low=0, help=(
        "print the step's longest sequences' lengths every this many steps (0: never)"))
    debug: bool = setting(False, help=(
        "print each step's microbatch plan: rows and padded tokens per microbatch, and "
        "retries after running out of memory"))
    eval: bool = setting(True, help=(
        "the held-out loss of every tier before and after training (--no-eval: neither)"))
    eval_sequences: int = setting(256, low=1, help=(
        "held-out sequences the evaluation reads at most, and never more tokens than the "
        "training trains"))
    out: Path | None = setting(None, help=(
        f"the run's folder: the final model, checkpoints/, tensorboard/ (without it "
        f"{DEFAULT_OUT}, or with --resume the checkpoint's run)"))


SECTIONS: dict[str, type] = {"model": ModelSection, "data": DataSection,
                             "training": TrainingSection, "hardware": HardwareSection,
                             "logging": LoggingSection}


def attribute(key: Field) -> str:
    """The name a key's value has on the command line's namespace: its flag's."""
    return flag_of(key).removeprefix("--").replace("-", "_")


# attribute → (section, key): where a seed config's options go
KEYS = {attribute(f): (name, f.name) for name, cls in SECTIONS.items() for f in fields(cls)}


def apply(args: argparse.Namespace) -> argparse.Namespace:
    """``args``, as parsed with the flags of the sections, with every key of train.toml
    checked and set: the defaults, then the ``--config`` file's keys, ``--set``, the flags."""
    flags = {name: given_flags(args, cls) for name, cls in SECTIONS.items()}
    file, overrides, seed, model_fields = args.config, args.set or [], None, None
    if file is not None and (file.suffix == ".toml" or seed_config.is_seed_config(file)):
        del flags["model"]["config"]  # --config names this file
        if file.suffix == ".toml":
            tables = read_toml(file)
        else:
            seed = seed_config.read(file, overrides, flags["data"].get("seq_len"))
            tables, overrides, model_fields = {}, [], seed.model
            for name, (_, value) in seed.options.items():
                section, key = KEYS[name]
                tables.setdefault(section, {})[key] = value
    elif overrides:
        raise ConfigError("--set overrides keys of a train.toml or a seed config JSON; "
                          "give --config train.toml.")
    else:
        tables = {}
    tables = apply_overrides(tables, overrides)
    _check_sections(tables)
    if isinstance(tiers := tables.get("training", {}).get("tiers"), list):
        tables["training"]["tiers"] = ",".join(map(str, tiers))  # tiers = [0, 1] is "0,1"
    model = tables.get("model", {})
    if model and not model.keys() & {"config", "init"}:
        reject_unknown("[model]", model, ["config", "init", *ModelConfig.__dataclass_fields__])
        model_fields, tables["model"] = dict(model), {}
    elif len(model) > 1:
        raise ConfigError(f"{file}: [model] takes config = \"model.json\", init = "
                          f"\"CHECKPOINT\" or the model's fields inline, one of them (it has "
                          f"{', '.join(model)}).")
    base = file.parent if file is not None else Path.cwd()
    for name, cls in SECTIONS.items():
        section = read_table(cls, {**tables.get(name, {}), **flags[name]}, name, base)
        for key in fields(section):
            setattr(args, attribute(key), getattr(section, key.name))
    args.model_fields = model_fields  # None: a config JSON, a checkpoint, or the tiny model
    if seed is not None:
        seed.check_tokenizer(args.data, args.strategy)
    return args


def _check_sections(tables: dict[str, Any]) -> None:
    for name, table in tables.items():
        if name not in SECTIONS:
            raise UnknownKey(f"train.toml has no section [{name}]; "
                             f"{did_you_mean(name, SECTIONS)}valid: {', '.join(SECTIONS)}.")
        if not isinstance(table, dict):
            raise WrongType(f"[{name}] must be a table, got {table!r}.")


def train_schema() -> dict[str, Any]:
    """The JSON schema (draft 2020-12) of train.toml."""
    schema = json_schema(SECTIONS, title="train.toml", description=(
        "A standalone training run (matformer-train --config); every key is also a flag."))
    sections = schema["properties"]
    sections["model"] = {"description": sections["model"].pop("description"), "anyOf": [
        {**sections["model"], "maxProperties": 1},
        {"type": "object", "propertyNames": {"enum": list(ModelConfig.__dataclass_fields__)},
         "description": "ModelConfig's fields inline (modeling/config.py)"}]}
    tiers = sections["training"]["properties"]["tiers"]
    tiers["anyOf"] = [{"type": "string", "pattern": f"^(?:{TIERS.pattern})$"},
                      {"type": "array", "items": {"type": "integer", "minimum": 0}}]
    del tiers["type"]
    return schema
