"""Matformer modeling: registry-built nested transformers.

Importing the package registers the built-in components.
"""

from modeling import components  # noqa: F401  (registers built-ins)
from modeling.batch import MaskedBatch, PackedBatch
from modeling.config import HOOK_POSITIONS, LayerConfig, ModelConfig
from modeling.equivalence import assert_batch_equivalent
from modeling.errors import (
    BatchError,
    ConfigError,
    HookPositionError,
    MatformerError,
    RegistryError,
    TierError,
)
from modeling.matformer import layer_widths, tier_width
from modeling.models import (
    AutoregressiveModel,
    BERTModel,
    NakedTransformer,
    TransformerWithEmbeddingHead,
    TransformerWithLMHead,
    build_model,
)
from modeling.naming import canonical_names, canonical_state_dict, load_canonical_state_dict
from modeling.registry import Registry, registry
from modeling.spec import Identity, ModuleSpec, build_module

__all__ = [
    "HOOK_POSITIONS",
    "AutoregressiveModel",
    "BERTModel",
    "BatchError",
    "ConfigError",
    "HookPositionError",
    "Identity",
    "LayerConfig",
    "MaskedBatch",
    "MatformerError",
    "ModelConfig",
    "ModuleSpec",
    "NakedTransformer",
    "PackedBatch",
    "Registry",
    "RegistryError",
    "TierError",
    "TransformerWithEmbeddingHead",
    "TransformerWithLMHead",
    "assert_batch_equivalent",
    "build_model",
    "build_module",
    "canonical_names",
    "canonical_state_dict",
    "layer_widths",
    "load_canonical_state_dict",
    "registry",
    "tier_width",
]
