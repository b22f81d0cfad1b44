"""Gradient compression for federated rounds (DESIGN.md §5): what a client sends, how the
coordinator aggregates it, and how both apply the update.

A client, per parameter and round (``rule`` is the run's, the same on every side)::

    compressor = CompressionConfig().build()                    # DeMo defaults: dct, 64, 32
    regions = tier_regions(universal_shapes(config), config, tier)
    state = compressor.feedback(name, shape, regions[name])    # once per parameter
    result = state.step(grad_slice, tokens)                     # → SparseResult, sent
    weight_slice = rule.apply(weight_slice, step, regions[name])   # the broadcast step

The coordinator, per parameter::

    rule = UpdateConfig(rule="sign", lr=1e-3, broadcast_topk=48).build()
    update = aggregate(results_from_all_clients)   # validates, then token-weighted mean
    step, residual = rule.step(update, [r.region for r in results], residual)
    master = rule.apply(master, step)              # a client: rule.apply(slice, step, region)

Public API:

SparseResult (sparse.py)
    The wire shape: name, universal shape, region, encoding, chunk, chunks, indices, values,
    tokens.
ChunkGrid.of(shape, size) -> ChunkGrid; .chunk_ids(region), .locate(ids, region),
.blocks(values, region), .assemble(blocks, region), .check_region(region); Region;
full_region, region_shape, region_slices (grid.py)
    Chunks cut on the universal shape; partial edge chunks zero-padded.
universal_config(config), universal_shapes(config) -> dict[str, shape];
tier_regions(shapes, config, tier) -> dict[str, Region]; tier_region(name, shape, config, tier)
    What a tier covers of each canonical tensor (regions.py).
dct_matrix(n), dct(blocks), idct(coefficients) (dct.py)
    Orthonormal DCT-II along every chunk dimension, and its exact inverse.
ENCODERS, get_encoding(name), decode(result) -> Tensor (encodings.py)
    dense | topk | dct; decode gives the region-shaped float32 values.
CompressionConfig(...).build() -> Compressor; Compressor.encode(name, values, *, shape,
region, tokens) -> SparseResult; Compressor.feedback(name, shape, region) -> ErrorFeedback
    Settings and encoding (compressor.py).
ErrorFeedback.step(grad, tokens) -> SparseResult (feedback.py)
    m ← β·m + lr·g; sent = encode(m); m ← m − decode(sent).
validate(result), validate_group(results) (validation.py)
    Raise a CompressionError subclass on anything malformed.
aggregate(results) -> Aggregate(values, tokens).covered; scatter(result) -> Aggregate
(aggregation.py)
    Coverage-normalised, token-weighted mean over the universal shape.
sgd, sign, UPDATE_RULES; UpdateConfig(rule, lr, weight_decay, broadcast_topk, chunk).build()
-> UpdateRule; UpdateRule.step(aggregate, covered, residual) -> (Step, residual),
.apply(weight, step, region=None); RoundUpdate(round, update, steps, hashes) .apply(state),
.cut(tier, regions) (update.py)
    The rules, and the one record of a round's update that is logged, sent and applied.
DenseStep, CoefficientStep, Step, dense_step, Broadcast(topk, chunk).encode(values, covered,
residual), intersect, bounding_box (steps.py)
    A parameter's update: exact, or top-k DCT levels decoded with exact integer arithmetic.
weight_hash(state, regions=None) -> str; tier_hashes(state, regions_by_tier) (hashing.py)
    The per-tier hash of the weights that the coordinator publishes and clients compare.
DENSE_BYTES_PER_VALUE, index_dtype(bound), payload_bytes(result), position_bits(numel),
pack_bits(values, bits), unpack_bits(data, bits, count) (wire.py)
    Smallest integer dtypes for ids and positions, bit packing, bytes on the wire.

Errors (modeling.errors, all CompressionError): CompressionConfigError, UnknownEncoding,
RegionError, ChunkIdError, ChunkIndexError, NonFiniteValues, ResultShapeMismatch,
BadTokenCount.
"""

from modeling.compression.aggregation import Aggregate, aggregate, scatter
from modeling.compression.compressor import VALUE_DTYPES, CompressionConfig, Compressor
from modeling.compression.dct import dct, dct_matrix, idct
from modeling.compression.encodings import ENCODERS, decode, get_encoding
from modeling.compression.feedback import ErrorFeedback
from modeling.compression.grid import (
    ChunkGrid,
    Region,
    full_region,
    region_shape,
    region_slices,
)
from modeling.compression.hashing import tier_hashes, weight_hash
from modeling.compression.regions import (
    tier_region,
    tier_regions,
    universal_config,
    universal_shapes,
)
from modeling.compression.sparse import SparseResult
from modeling.compression.steps import (
    Broadcast,
    CoefficientStep,
    DenseStep,
    Step,
    bounding_box,
    dense_step,
    intersect,
)
from modeling.compression.update import (
    UPDATE_RULES,
    RoundUpdate,
    UpdateConfig,
    UpdateRule,
    sgd,
    sign,
)
from modeling.compression.validation import validate, validate_group
from modeling.compression.wire import (
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
    "Aggregate",
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
    "aggregate",
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
    "scatter",
    "sgd",
    "sign",
    "tier_hashes",
    "tier_region",
    "tier_regions",
    "universal_config",
    "universal_shapes",
    "unpack_bits",
    "validate",
    "validate_group",
    "weight_hash",
]
