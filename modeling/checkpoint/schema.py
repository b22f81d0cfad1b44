"""Schema hashes: do two checkpoints describe the same model?

The local hash covers the config as loaded and the sorted parameter names. The canonical
hash first moves the config to tier 0 at the base FFN width, so a universal checkpoint and
every one of its slices (Mix'n'Match ones too) share it, while any other architecture
differs. Parameter names follow from the config, so comparing configs alone may pass none.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable

from matformer.modeling.config import ModelConfig

# Fields that change how a model is initialised or found, not what it computes.
_NOT_ARCHITECTURE = ("initializer_range", "external_modules_path")


def _digest(config: ModelConfig, parameter_names: Iterable[str]) -> str:
    described = config.to_dict()
    for key in _NOT_ARCHITECTURE:
        described.pop(key)
    payload = json.dumps({"config": described, "parameters": sorted(parameter_names)},
                         sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()


def local_schema_hash(config: ModelConfig, parameter_names: Iterable[str]) -> str:
    return _digest(config, parameter_names)


def canonical_schema_hash(config: ModelConfig, parameter_names: Iterable[str]) -> str:
    universal = dataclasses.replace(
        config, intermediate_size=config.matformer_base_intermediate_size, matformer_tier=0,
        matformer_layer_tiers=None,
    )
    return _digest(universal, parameter_names)
