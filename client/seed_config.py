"""Seed 000's config JSON (``model_config``, ``training``, ``tokenizer``, ``data``, and
``save_dir``, ``wandb_project``, ``wandb_run_name`` at the top), read onto matformer-train:

    model_config                  the model (ModelConfig.from_dict reads ffn_factor and
                                  training_objective too); its max_position_embeddings is
                                  also --seq-len, the length the seed trains at
    training.optimizer, lr, final_lr, warmup_steps, hold_steps, weight_decay, seed
                                  the options of the same name
    training.scheduler            --schedule (the seed's "custom" is its cosine)
    training.lr_scheduling        false: a constant lr, without warmup or hold
    training.gradient_clip_val    --grad-clip
    training.max_epochs           --epochs
    training.save_every_n_steps   --save-every
    data.batch_size, training.accumulate_grad_batches
                                  sequences per pass, passes per step: --microbatch-examples
                                  B, --microbatch-tokens B x seq_len, --batch-tokens
                                  B x accumulate_grad_batches x seq_len
    data.data_root, mdat_strategy, mdat_view      --data, --strategy, --view
    data.num_workers              --num-workers: threads reading the next steps ahead
    tokenizer.varlen_strategy     --batching: padding is padded, unpadding is packed
    tokenizer.type, pretrained_name   must be the data's: a strategy owns its tokenizer
    save_dir, wandb_run_name      --out SAVE_DIR/RUN_NAME (a run is named after its folder)
    wandb_project                 --project, and --track wandb where wandb is installed

Paths are relative to the JSON's folder, as train.toml's are; a null is a key not given.
Any other key is refused, all of them in one error.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from matformer.modeling.commands import apply_overrides
from matformer.modeling.config import SEED_SPELLINGS, LayerConfig, ModelConfig
from matformer.modeling.errors import ConfigError, did_you_mean
from matformer.modeling.mdat import DEFAULT_STRATEGY, Mdat

log = logging.getLogger("matformer.config")

SECTIONS = ("model_config", "training", "tokenizer", "data")
SAME = {  # key (section.key) → the option it is
    "training.optimizer": "optimizer", "training.lr": "lr", "training.final_lr": "final_lr",
    "training.warmup_steps": "warmup_steps", "training.hold_steps": "hold_steps",
    "training.weight_decay": "weight_decay", "training.seed": "seed",
    "training.gradient_clip_val": "grad_clip", "training.max_epochs": "epochs",
    "training.save_every_n_steps": "save_every", "data.data_root": "data",
    "data.mdat_strategy": "strategy", "data.mdat_view": "view", "wandb_project": "project",
    "data.num_workers": "num_workers",
}
DERIVED = ("training.scheduler", "training.lr_scheduling", "training.accumulate_grad_batches",
           "data.batch_size", "tokenizer.varlen_strategy", "tokenizer.type",
           "tokenizer.pretrained_name", "save_dir", "wandb_run_name")
SCHEDULERS = {"custom": "cosine", "cosine": "cosine", "linear": "linear",
              "constant": "constant"}
VARLEN = {"padding": "padded", "unpadding": "packed"}


@dataclass(frozen=True, slots=True)
class SeedRun:
    """What a seed config asks for: the model's fields, and option → (its key, value)."""

    model: dict[str, Any]
    options: dict[str, tuple[str, Any]]
    tokenizer: dict[str, Any]

    def check_tokenizer(self, data: Path | None, strategy: str) -> None:
        """Refuse a tokenizer section that is not the one the data were tokenized with."""
        named = {key: self.tokenizer.get(key) for key in ("type", "pretrained_name")}
        if not any(named.values()):
            return
        if data is None:
            used = DEFAULT_STRATEGY
        else:
            with Mdat.open(data) as mdat:
                used = mdat.strategy(strategy).to_dict()
        actual = {"type": used.get("tokenizer_type"), "pretrained_name": used.get("tokenizer_name")}
        wrong = [key for key, value in named.items() if value and value != actual[key]]
        if wrong:
            raise ConfigError(
                f"tokenizer.{wrong[0]} {named[wrong[0]]!r} is not the data's: strategy "
                f"{strategy!r} was tokenized with {actual['type']} {actual['pretrained_name']!r}, "
                "whose ids the model trains on and whose tokenizer it is saved with; name that "
                "one, pretokenize the data with yours, or leave the tokenizer section out.")


def is_seed_config(path: Path) -> bool:
    """Whether ``path`` holds a seed config (a bare model config otherwise)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return False  # ModelConfig.from_json says what is wrong with it
    return isinstance(data, dict) and any(section in data for section in SECTIONS)


def read(path: Path, overrides: list[str], seq_len: int | None) -> SeedRun:
    """The seed config at ``path`` after ``--set SECTION.KEY=VALUE`` ``overrides`` (VALUE in
    TOML syntax); ``seq_len``: the command line's, if it gave one."""
    data = apply_overrides(json.loads(path.read_text()), overrides)
    _check_keys(path, data)
    model = ModelConfig.from_dict(data.get("model_config") or {})
    values = _run_values(data)
    seq_len = seq_len or model.max_position_embeddings
    options = [(key, SAME[key], value) for key, value in values.items() if key in SAME]
    options += [("model_config.max_position_embeddings", "seq_len", seq_len)]
    options += _derived(values, seq_len)  # after: lr_scheduling false outweighs warmup_steps
    by_option = {dest: (key, value) for key, dest, value in options if value is not None}
    return SeedRun(model.to_dict(), by_option, data.get("tokenizer") or {})


def _derived(values: dict[str, Any], seq_len: int) -> list[tuple[str, str, Any]]:
    options = []
    if not isinstance(values.get("training.lr_scheduling", True), bool):
        raise ConfigError(f"training.lr_scheduling must be true or false, got "
                          f"{values['training.lr_scheduling']!r}.")
    if values.get("training.lr_scheduling") is False:
        options += [("training.lr_scheduling", "schedule", "constant"),
                    ("training.lr_scheduling", "warmup_steps", 0),
                    ("training.lr_scheduling", "hold_steps", 0)]
    elif "training.scheduler" in values:
        options.append(("training.scheduler", "schedule",
                        _choice(values, "training.scheduler", SCHEDULERS)))
    batch, steps = values.get("data.batch_size"), values.get("training.accumulate_grad_batches")
    if steps is not None and batch is None:
        raise ConfigError("training.accumulate_grad_batches counts passes of data.batch_size "
                          "sequences; give data.batch_size too.")
    if batch is not None:
        steps = steps or 1
        if not all(isinstance(n, int) and n >= 1 for n in (batch, steps)):
            raise ConfigError(f"data.batch_size {batch!r} and training.accumulate_grad_batches "
                              f"{steps!r} must be whole numbers of at least 1.")
        options += [("data.batch_size", "microbatch_examples", batch),
                    ("data.batch_size", "microbatch_tokens", batch * seq_len),
                    ("training.accumulate_grad_batches", "batch_tokens", batch * steps * seq_len)]
    if "tokenizer.varlen_strategy" in values:
        options.append(("tokenizer.varlen_strategy", "batching",
                        _choice(values, "tokenizer.varlen_strategy", VARLEN)))
    if values.get("save_dir") is not None:
        out = Path(values["save_dir"]) / (values.get("wandb_run_name") or "")
        options.append(("save_dir", "out", str(out)))
    if values.get("wandb_project") is not None:
        if importlib.util.find_spec("wandb") is not None:
            options.append(("wandb_project", "track", "wandb"))
        else:
            log.warning("matformer-train: wandb_project: wandb is not installed (pip install "
                        "wandb); the figures go to TensorBoard event files instead")
    return options


def _choice(values: dict[str, Any], key: str, choices: dict[str, str]) -> str:
    if values[key] not in choices:
        raise ConfigError(f"{key} {values[key]!r} is not one of {', '.join(choices)}.")
    return choices[values[key]]


def _check_keys(path: Path, data: dict[str, Any]) -> None:
    """One error naming every key there is no mapping for."""
    for section in SECTIONS:
        if not isinstance(data.get(section) or {}, dict):
            raise ConfigError(f"{path}: {section} must be an object of keys.")
    model = data.get("model_config") or {}
    layer = model.get("default_layer") or {}
    model_keys = [*(f.name for f in fields(ModelConfig)), *SEED_SPELLINGS]
    layer_keys = [f.name for f in fields(LayerConfig)]
    run_keys = [*SAME, *DERIVED]
    unknown = [_named(f"model_config.{key}", key, model_keys)
               for key in model if key not in model_keys]
    if isinstance(layer, dict):
        unknown += [_named(f"model_config.default_layer.{key}", key, layer_keys)
                    for key in layer if key not in layer_keys]
    unknown += [_named(key, key, run_keys) for key in _run_values(data) if key not in run_keys]
    if unknown:
        raise ConfigError(f"{path}: matformer-train cannot map {', '.join(unknown)}; remove "
                          "them, or write the run as a train.toml (examples/train.toml).")


def _named(key: str, name: str, valid: list[str]) -> str:
    hint = did_you_mean(name, valid).strip()
    return f"{key!r} ({hint})" if hint else repr(key)


def _run_values(data: dict[str, Any]) -> dict[str, Any]:
    """Every key but the model's, dotted (training.lr), with its value."""
    values = {f"{section}.{key}": value for section in SECTIONS[1:]
              for key, value in (data.get(section) or {}).items()}
    values.update({key: value for key, value in data.items() if key not in SECTIONS})
    return values

