"""`matformer-train --config train.toml`: a whole training run in one file.

    [model]      config = "model.json", or the model's fields inline (hidden_size = 512, ...)
    [data]       path, documents, strategy, view, seq_len, batching
    [training]   steps | epochs, optimizer, lr, final_lr, warmup_steps, hold_steps, schedule,
                 weight_decay, grad_clip, batch_tokens, microbatch_tokens, microbatch_examples,
                 tiers, tier_mode, seed, save_every, keep_last
    [hardware]   device, precision, compile, fsdp
    [logging]    track, project, log_every, out

Every key is a command-line option of ``matformer-train`` (``[data] path`` is ``--data``,
``[model] config`` is ``--config``), typed and checked by that option's own parser; an
unknown section or key is refused naming the valid ones. ``--set SECTION.KEY=VALUE``
overrides a key of the file, and a flag given on the command line overrides both.
``examples/train.toml`` shows every key with its default. A ``--config`` JSON in seed 000's
layout (``model_config``, ``training``, ``tokenizer``, ``data``) is read onto the same options
by `client.seed_config` (``--set`` takes its dotted keys there: ``training.lr=0.001``); any
other ``--config`` that is not a ``.toml`` file is a bare model config, as before.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from pathlib import Path
from typing import Any

from client import seed_config
from modeling.config import ModelConfig
from modeling.errors import ConfigError, did_you_mean

SECTIONS: dict[str, tuple[str, ...]] = {
    "model": ("config", "init"),
    "data": ("path", "documents", "strategy", "view", "seq_len", "batching"),
    "training": ("steps", "epochs", "optimizer", "lr", "final_lr", "warmup_steps", "hold_steps",
                 "schedule", "weight_decay", "grad_clip", "batch_tokens", "microbatch_tokens",
                 "microbatch_examples", "tiers", "tier_mode", "seed", "save_every", "keep_last"),
    "hardware": ("device", "precision", "compile", "fsdp"),
    "logging": ("track", "project", "log_every", "out"),
}
DESTINATIONS = {("data", "path"): "data"}  # keys whose option has another name


def apply(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """``args`` with the ``--config`` TOML's values (after ``--set``) wherever the command
    line left an option at its default."""
    if args.config is not None and args.config.suffix != ".toml" and \
            seed_config.is_seed_config(args.config):
        return _apply_seed(args, parser)
    if args.config is None or args.config.suffix != ".toml":
        if args.set:
            raise ConfigError("--set overrides keys of a train.toml or a seed config JSON; "
                              "give --config train.toml.")
        return args
    tables = _read(args.config)
    for override in args.set or []:
        _override(tables, override)
    model = tables.get("model", {})
    named = [key for key in SECTIONS["model"] if key in model]
    if named and len(model) > 1:
        raise ConfigError(f"{args.config}: [model] takes config = \"model.json\", init = "
                          f"\"CHECKPOINT\" or the model's fields inline, one of them (it has "
                          f"{', '.join(model)}).")
    actions = {a.dest: a for a in parser._actions}
    defaults = {dest: action.default for dest, action in actions.items()}
    args.model_fields, model_config = None, None
    for section, table in tables.items():
        if section == "model" and not named:
            args.model_fields = _model_fields(table)
            continue
        for key, value in table.items():
            dest = DESTINATIONS.get((section, key), key)
            converted = _converted(actions[dest], f"[{section}] {key}", value, args.config.parent)
            if (section, key) == ("model", "config"):
                model_config = converted  # --config itself names this file
            elif (section, key) == ("model", "init") and args.init is None:
                folder = args.config.parent / converted  # a folder beside it, or a hub id
                args.init = str(folder) if folder.exists() else converted
            elif getattr(args, dest) == defaults[dest]:
                setattr(args, dest, converted)
    args.config = model_config  # None: inline fields, or no [model] (the default tiny model)
    return args


def _apply_seed(args: argparse.Namespace, parser: argparse.ArgumentParser
                ) -> argparse.Namespace:
    """``apply`` for a seed config JSON: its keys where the command line left the default."""
    actions = {a.dest: a for a in parser._actions}
    given_seq_len = None if args.seq_len == actions["seq_len"].default else args.seq_len
    run = seed_config.read(args.config, args.set or [], given_seq_len)
    for dest, (key, value) in run.options.items():
        if getattr(args, dest) == actions[dest].default:
            setattr(args, dest, _converted(actions[dest], key, value, args.config.parent))
    run.check_tokenizer(args.data, args.strategy)
    args.model_fields, args.config = run.model, None
    return args


def _read(path: Path) -> dict[str, dict[str, Any]]:
    try:
        tables = tomllib.loads(path.read_text())
    except OSError as err:
        raise ConfigError(f"--config {path}: {err.strerror or err}.") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"--config {path} is not valid TOML: {err}.") from None
    for section, table in tables.items():
        if section not in SECTIONS:
            raise ConfigError(f"{path}: unknown section [{section}]; "
                              f"{did_you_mean(section, SECTIONS)}valid: {', '.join(SECTIONS)}.")
        if not isinstance(table, dict):
            raise ConfigError(f"{path}: {section} must be a [{section}] table.")
        if section == "model" and not set(SECTIONS["model"]) & set(table):
            continue  # inline model fields, checked against ModelConfig
        for key in table:
            if key not in SECTIONS[section]:
                raise ConfigError(
                    f"{path}: unknown key {key!r} in [{section}]; "
                    f"{did_you_mean(key, SECTIONS[section])}valid: "
                    f"{', '.join(SECTIONS[section])}.")
    return tables


def _override(tables: dict[str, dict[str, Any]], override: str) -> None:
    """``SECTION.KEY=VALUE`` into ``tables``; VALUE is read as TOML, else as a string."""
    target, _, raw = override.partition("=")
    section, _, key = target.partition(".")
    if not raw or not key or section not in SECTIONS or (
            section != "model" and key not in SECTIONS[section]):
        raise ConfigError(f"--set {override!r}: give SECTION.KEY=VALUE with a key of "
                          f"train.toml (sections: {', '.join(SECTIONS)}).")
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    tables.setdefault(section, {})[key] = value


def _converted(action: argparse.Action, name: str, value: Any, base: Path) -> Any:
    """``value`` as the option's own parser would take it, or a ConfigError naming it."""
    if isinstance(action, argparse._StoreTrueAction):
        if not isinstance(value, bool):
            raise ConfigError(f"{name} must be true or false, got {value!r}.")
        return value
    if isinstance(value, list):  # tiers = [0, 1, 2]
        value = ",".join(str(v) for v in value)
    if isinstance(value, bool | dict):
        raise ConfigError(f"{name} must be a number or a string, got {value!r}.")
    try:
        converted = action.type(str(value)) if action.type else str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: {value!r} is not a valid "
                          f"{getattr(action.type, '__name__', 'value')}.") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigError(f"{name} {value!r} is not one of "
                          f"{', '.join(map(str, action.choices))}.")
    if isinstance(converted, Path) and not converted.is_absolute():
        # relative to the train.toml, like run.toml's paths, and said without "examples/.."
        converted = Path(os.path.normpath(base / converted))
    return converted


def _model_fields(table: dict[str, Any]) -> dict[str, Any]:
    known = ModelConfig.__dataclass_fields__
    for key in table:
        if key not in known:
            raise ConfigError(f"unknown key {key!r} in [model]; {did_you_mean(key, known)}"
                              "give config = \"model.json\" or ModelConfig's fields.")
    return dict(table)
