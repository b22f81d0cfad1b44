"""Matformer modeling: registry-built nested transformers.

Importing the package registers the built-in components.
"""

from matformer.modeling import components  # noqa: F401  (registers built-ins)
from matformer.modeling.batch import MaskedBatch, PackedBatch
from matformer.modeling.config import HOOK_POSITIONS, LayerConfig, ModelConfig
from matformer.modeling.equivalence import assert_batch_equivalent
from matformer.modeling.errors import (
    BatchError,
    ConfigError,
    HookPositionError,
    MatformerError,
    RegistryError,
    TierError,
)
from matformer.modeling.matformer import layer_widths, tier_width
from matformer.modeling.models import (
    AutoregressiveModel,
    BERTModel,
    NakedTransformer,
    TransformerWithEmbeddingHead,
    TransformerWithLMHead,
    build_model,
)
from matformer.modeling.naming import (
    canonical_names,
    canonical_state_dict,
    load_canonical_state_dict,
)
from matformer.modeling.registry import Registry, registry
from matformer.modeling.spec import Identity, ModuleSpec, build_module

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
