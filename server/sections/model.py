"""[model], [data] and [tiers]: the model a run trains, the data it trains on and the tiers
its members may train."""

from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matformer.modeling.checkpoint.files import CONFIG_NAME
from matformer.modeling.checkpoint.hf_config import from_config_dict
from matformer.modeling.checkpoint.loader import resolve
from matformer.modeling.checkpoint.pretrained import read_config
from matformer.modeling.checkpoint.remote_code import consented
from matformer.modeling.compression import universal_shapes
from matformer.modeling.config import ModelConfig
from matformer.modeling.errors import MatformerError
from matformer.modeling.matformer import FIRST_MIX_ID, MAX_MIXES, TierIds
from matformer.modeling.mdat import DEFAULT_STRATEGY
from matformer.modeling.settings import INT64, FolderOrRepo, reject_unknown, setting
from matformer.server.errors import ConflictingKeys, InvalidValue, MissingFile, MissingKey
from matformer.server.sections.checks import require, within
from matformer.server.tiers import TierPolicy

MAX_DIMENSION = 2**24  # vocab_size, hidden_size, intermediate_size, max_position_embeddings
MAX_LAYERS = 1024  # the coordinator builds the model (on the meta device) to read its shapes
MAX_TIER = MAX_DIMENSION.bit_length() - 1  # a tier halves the FFN width: 24 halvings at most
# Fractions of a target mix may be written to a few digits: 0.33 + 0.33 + 0.34.
_MIX_TOLERANCE = 1e-6


@dataclass(kw_only=True, slots=True)
class ModelSection:
    """Where the model comes from: exactly one of the three keys."""

    inline: dict[str, Any] | None = setting(None, help=(
        "ModelConfig fields, as in config.json (modeling/config.py)"))
    config_path: Path | None = setting(None, help=(
        "a config.json (Matformer's or a Hugging Face Llama one); random init"))
    checkpoint: FolderOrRepo | None = setting(None, help=(
        "a universal checkpoint whose weights start the run: ours or a Hugging Face Llama, "
        "as a folder or a hub id the hub cache holds or can download"))
    trust_remote_code: bool = setting(False, help=(  # clients decide for themselves
        "run the module files the checkpoint carries (read them first); off: its model must "
        "be built of registered components"))

    def __post_init__(self) -> None:
        given = [k for k in ("inline", "config_path", "checkpoint") if getattr(self, k) is not None]
        if not given:
            raise MissingKey("[model] needs one of: a [model.inline] table of model config "
                             "fields, config_path (a config.json) or checkpoint (a folder).")
        if len(given) > 1:
            raise ConflictingKeys(f"[model] gives {' and '.join(given)}; keep exactly one.")
        if self.inline is not None:
            reject_unknown("[model.inline]", self.inline, list(ModelConfig.__dataclass_fields__))
        _check_size(self.build())

    def build(self) -> ModelConfig:
        """The run's (universal) model config."""
        if self.inline is not None:
            where = "[model.inline]"
            config = _model(where, lambda: ModelConfig.from_dict(self.inline))
        else:
            folder = self.checkpoint_folder()
            path = self.config_path if folder is None else folder / CONFIG_NAME
            where = f"[model] {path}"
            if not path.is_file():
                raise MissingFile(f"{where} does not exist; fix the path in [model].")
            if folder is None:
                config = _model(where, lambda: from_config_dict(json.loads(path.read_text())))
            else:  # its module files are the checkpoint's, found and allowed as for any load
                config = _model(where, lambda: consented(
                    read_config(folder), self.trust_remote_code, folder))
        require(config.matformer_tier == 0 and config.matformer_layer_tiers is None,
                f"{where} describes a tier {config.matformer_tier} slice; a run trains the "
                "universal (tier 0) model, so point [model] at the universal config.")
        return config

    def checkpoint_folder(self) -> Path | None:
        """The local folder of ``checkpoint``: the folder it names, or, for a hub id, the
        snapshot in the hub cache holding its universal config and weights."""
        if self.checkpoint is None:
            return None
        if not self.checkpoint.is_repo:
            return Path(self.checkpoint)
        return _hub_folder(str(self.checkpoint))


@functools.lru_cache(maxsize=8)
def _hub_folder(repo_id: str) -> Path:
    """A hub repository's universal files, fetched (or found in the cache) once."""
    try:
        return resolve(repo_id, 0, "universal").directory
    except MatformerError as err:
        raise MissingFile(
            f"[model] checkpoint {repo_id!r} is no folder here, and as a hub id it gave: {err} "
            f"Download it first (huggingface-cli download {repo_id}), or give its folder."
        ) from err


def _check_size(config: ModelConfig) -> None:
    """A model the coordinator can build and hold: sizes within MAX_DIMENSION and MAX_LAYERS,
    finite numbers, and a float32 master that fits in this machine's memory."""
    for key in ("vocab_size", "hidden_size", "intermediate_size", "max_position_embeddings"):
        within(f"[model] {key}", getattr(config, key), 1, MAX_DIMENSION)
    within("[model] num_hidden_layers", config.num_hidden_layers, 1, MAX_LAYERS)
    nonfinite = _first_nonfinite(config.to_dict())
    require(nonfinite is None, f"[model] {nonfinite} is not a finite number; give a finite one.")
    parameters = sum(math.prod(shape) for shape in universal_shapes(config).values())
    master, memory = 4 * parameters, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    require(master <= memory,
            f"[model] has {parameters:,} parameters, whose float32 master alone takes "
            f"{master / 2**30:,.1f} GiB, more than this machine's {memory / 2**30:,.1f} GiB of "
            "memory; choose a smaller model.")


def _first_nonfinite(value: Any, where: str = "") -> str | None:
    """``key.key = value`` for the first infinite or NaN float in plain data, if any."""
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{where} = {value}"
    children = (value.items() if isinstance(value, dict)
                else enumerate(value) if isinstance(value, list | tuple) else ())
    found = (_first_nonfinite(child, f"{where}.{key}" if where else str(key))
             for key, child in children)
    return next((f for f in found if f is not None), None)


def _model(where: str, make: Callable[[], ModelConfig]) -> ModelConfig:
    try:
        return make()
    except json.JSONDecodeError as err:
        raise InvalidValue(f"{where} is not valid JSON: {err}.") from err
    except MatformerError as err:
        raise InvalidValue(f"{where}: {err}") from err


@dataclass(kw_only=True, slots=True)
class DataSection:
    path: Path = setting(help="the MDAT container")
    strategy: str = setting(DEFAULT_STRATEGY["strategy_name"],
                            help="the container's pretokenization strategy")
    view: str | None = setting(None, help="a view of the container; unset: all of it")
    max_seq_len: int = setting(256, low=1, high=2**20, help=(
        "tokens per sequence, a multiple of the strategy's chunk size"))
    seed: int = setting(0, low=0, high=INT64[1], help=(  # numpy's shuffle needs seed >= 0
        "seed of the shuffle that orders sequences over rounds"))


@dataclass(kw_only=True, slots=True)
class TiersSection:
    allowed: list[int] = setting([0, 1, 2], help=(
        f"tiers clients may be given, 0..{MAX_TIER}; each must halve the FFN evenly"))
    layer_mixes: list[list[int]] = setting([], help=(
        "Mix'n'Match slices clients may be given as well, one allowed tier per layer, never "
        f"wider with depth (what matformer slice chose); the k-th is tier {FIRST_MIX_ID}+k"))
    pins: dict[str, int] = setting({}, help="client name → tier, always")
    mix: dict[int, float] = setting({}, help=(
        "tier → target share of members, summing to 1; empty: none"))

    def __post_init__(self) -> None:
        require(bool(self.allowed), "[tiers] allowed is empty; list at least one tier.")
        require(all(0 <= t <= MAX_TIER for t in self.allowed)
                and len(set(self.allowed)) == len(self.allowed),
                f"[tiers] allowed must list distinct tiers in [0, {MAX_TIER}], got "
                f"{self.allowed}.")
        require(len(self.layer_mixes) <= MAX_MIXES, f"[tiers] layer_mixes lists "
                f"{len(self.layer_mixes)} slices; at most {MAX_MIXES}.")
        for k, layers in enumerate(self.layer_mixes):
            where = f"[tiers] layer_mixes[{k}] {layers}"
            require(all(t in self.allowed for t in layers),
                    f"{where} uses a tier that is not in allowed {self.allowed}; a slice is "
                    "made of the run's tiers.")
            require(layers == sorted(layers), f"{where} grows wider with depth; a deeper layer "
                    "must use the same tier or a higher one.")
            require(len(set(layers)) > 1, f"{where} is tier {layers[0] if layers else '?'} on "
                    "every layer; list that tier in allowed instead.")
            require(layers not in self.layer_mixes[:k], f"{where} is listed twice.")
        ids = self.ids()
        for name, tier in self.pins.items():
            require(tier in ids,
                    f"[tiers.pins] pins {name!r} to tier {tier}, which is not one of the run's "
                    f"tiers {ids}; add it to allowed (or layer_mixes) or pin another tier.")
        if self.mix:
            for tier, share in self.mix.items():
                require(tier in ids,
                        f"[tiers.mix] names tier {tier}, which is not one of the run's tiers "
                        f"{ids}.")
                require(0.0 <= share <= 1.0,
                        f"[tiers.mix] share of tier {tier} must lie in [0, 1], got {share}.")
            total = sum(self.mix.values())
            require(abs(total - 1.0) <= _MIX_TOLERANCE,
                    f"[tiers.mix] shares sum to {total:g}; make them sum to 1.")

    def tier_ids(self) -> TierIds:
        """What each of the run's tier ids stands for."""
        return TierIds(tuple(tuple(layers) for layers in self.layer_mixes))

    def ids(self) -> list[int]:
        """Every tier a member may be given: the allowed tiers, then the slices' ids."""
        return [*self.allowed, *self.tier_ids().ids()]

    def build(self, model: ModelConfig) -> TierPolicy:
        return TierPolicy(model, allowed=self.ids(), pins=self.pins, mix=self.mix,
                          tier_ids=self.tier_ids())
