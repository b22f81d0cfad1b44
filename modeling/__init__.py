"""Matformer modeling: registry-built nested transformers.

Importing the package registers the built-in components.
"""

from matformer.modeling import components  # noqa: F401  (registers built-ins)
from matformer.modeling.batch import MaskedBatch, PackedBatch
from matformer.modeling.batch_helpers import (
    batch_ones,
    batch_zeros,
    causal_mask,
    join_dims,
    split_dim,
)
from matformer.modeling.config import HOOK_POSITIONS, LayerConfig, ModelConfig
from matformer.modeling.equivalence import assert_batch_equivalent
from matformer.modeling.errors import (
    BatchControlFlowError,
    BatchDimError,
    BatchError,
    BatchOpError,
    BatchShapeError,
    ConfigError,
    DynamicDimError,
    HookPositionError,
    MatformerError,
    RegistryError,
    TierError,
    UnsupportedBatchOp,
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
    "BatchControlFlowError",
    "BatchDimError",
    "BatchError",
    "BatchOpError",
    "BatchShapeError",
    "ConfigError",
    "DynamicDimError",
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
    "UnsupportedBatchOp",
    "assert_batch_equivalent",
    "batch_ones",
    "batch_zeros",
    "build_model",
    "build_module",
    "canonical_names",
    "canonical_state_dict",
    "causal_mask",
    "join_dims",
    "layer_widths",
    "load_canonical_state_dict",
    "registry",
    "split_dim",
    "tier_width",
]
