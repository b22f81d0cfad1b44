"""The arithmetic a federated round shares between coordinator and clients (docs/architecture.md,
"One round" and "The update record"): what a client sends (chunks on universal shapes,
encodings, error feedback), the update rules and steps every replica applies, and the per-tier
weight hash that proves replicas equal. Aggregation and choosing a round's steps are the
coordinator's alone (``server/aggregation.py``, ``server/update_steps.py``).
"""

from matformer.modeling.compression.compressor import VALUE_DTYPES, CompressionConfig, Compressor
from matformer.modeling.compression.dct import dct, dct_matrix, idct
from matformer.modeling.compression.encodings import ENCODERS, decode, get_encoding
from matformer.modeling.compression.feedback import ErrorFeedback
from matformer.modeling.compression.grid import (
    ChunkGrid,
    Region,
    full_region,
    region_shape,
    region_slices,
)
from matformer.modeling.compression.hashing import tier_hashes, weight_hash
from matformer.modeling.compression.regions import (
    tier_region,
    tier_regions,
    universal_config,
    universal_shapes,
)
from matformer.modeling.compression.sparse import SparseResult
from matformer.modeling.compression.steps import (
    Broadcast,
    CoefficientStep,
    DenseStep,
    Step,
    bounding_box,
    dense_step,
    intersect,
)
from matformer.modeling.compression.update import (
    UPDATE_RULES,
    RoundUpdate,
    UpdateConfig,
    UpdateRule,
    sgd,
    sign,
)
from matformer.modeling.compression.validation import (
    ValidResult,
    validate,
    validate_all,
    validate_group,
)
from matformer.modeling.compression.wire import (
    DENSE_BYTES_PER_VALUE,
    index_dtype,
    pack_bits,
    payload_bytes,
    position_bits,
    unpack_bits,
)

__all__ = [
    "DENSE_BYTES_PER_VALUE",
    "ENCODERS",
    "UPDATE_RULES",
    "VALUE_DTYPES",
    "Broadcast",
    "ChunkGrid",
    "CoefficientStep",
    "CompressionConfig",
    "Compressor",
    "DenseStep",
    "ErrorFeedback",
    "Region",
    "RoundUpdate",
    "SparseResult",
    "Step",
    "UpdateConfig",
    "UpdateRule",
    "ValidResult",
    "bounding_box",
    "dct",
    "dct_matrix",
    "decode",
    "dense_step",
    "full_region",
    "get_encoding",
    "idct",
    "index_dtype",
    "intersect",
    "pack_bits",
    "payload_bytes",
    "position_bits",
    "region_shape",
    "region_slices",
    "sgd",
    "sign",
    "tier_hashes",
    "tier_region",
    "tier_regions",
    "universal_config",
    "universal_shapes",
    "unpack_bits",
    "validate",
    "validate_all",
    "validate_group",
    "weight_hash",
]
