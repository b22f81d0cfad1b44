"""Which region of each universal tensor a tier covers (docs/architecture.md, "Names, tiers,
regions").

The answer comes from ``modeling.checkpoint.slicing``, the one place that knows which
canonical names are FFN weights and along which axis they narrow: a tier's region of a
tensor is the shape of its tier slice, from index 0. Everything but gate/up rows and down
columns is covered whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import torch

from matformer.modeling.checkpoint.slicing import slice_state
from matformer.modeling.compression.grid import Region
from matformer.modeling.config import ModelConfig
from matformer.modeling.matformer import Tier, layer_widths
from matformer.modeling.models import build_model
from matformer.modeling.naming import canonical_state_dict


def universal_config(config: ModelConfig) -> ModelConfig:
    """The tier-0 config of a (possibly sliced) checkpoint's config."""
    return dataclasses.replace(
        config, intermediate_size=config.matformer_base_intermediate_size,
        matformer_tier=0, matformer_layer_tiers=None,
    )


def universal_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name → universal shape, from a model built on the meta device (no memory)."""
    with torch.device("meta"):
        model = build_model(universal_config(config))
    return {name: tuple(t.shape) for name, t in canonical_state_dict(model).items()}


def tier_regions(
    shapes: Mapping[str, Sequence[int]], config: ModelConfig, tier: Tier
) -> dict[str, Region]:
    """Canonical name → the region that ``tier`` covers, for universal ``shapes``."""
    widths = layer_widths(config, tier)
    meta = {name: torch.empty(tuple(shape), device="meta") for name, shape in shapes.items()}
    return {
        name: tuple((0, size) for size in sliced.shape)
        for name, sliced in slice_state(meta, widths).items()
    }


def tier_region(name: str, shape: Sequence[int], config: ModelConfig, tier: Tier) -> Region:
    """The region of one canonical tensor, of universal ``shape``, that ``tier`` covers."""
    return tier_regions({name: shape}, config, tier)[name]
