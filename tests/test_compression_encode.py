"""Encodings, the DCT, error feedback and wire sizes."""

from __future__ import annotations

import math

import pytest
import torch

from matformer.modeling.compression import (
    ChunkGrid,
    CompressionConfig,
    dct,
    dct_matrix,
    decode,
    full_region,
    idct,
    index_dtype,
    payload_bytes,
)
from matformer.modeling.errors import CompressionConfigError, UnknownEncoding

SHAPE = (192, 100)
TIER1 = ((0, 96), (0, 100))  # ends mid-chunk: partial edge chunks in both dimensions


def _encode(encoding: str, values: torch.Tensor, region=TIER1, **settings):
    compressor = CompressionConfig(encoding=encoding, chunk=64, **settings).build()
    return compressor.encode("w", values, shape=SHAPE, region=region, tokens=5)


def test_dct_matrix_is_the_orthonormal_dct_ii():
    n = 8
    expected = torch.tensor([
        [math.sqrt((1 if k == 0 else 2) / n) * math.cos(math.pi * (2 * i + 1) * k / (2 * n))
         for i in range(n)] for k in range(n)
    ])
    torch.testing.assert_close(dct_matrix(n), expected)
    torch.testing.assert_close(dct_matrix(64) @ dct_matrix(64).T, torch.eye(64))


def test_dct_round_trip_is_exact_to_fp32_round_off():
    for blocks in (torch.randn(7, 64, 64), torch.randn(5, 64), torch.randn(3, 16, 64)):
        torch.testing.assert_close(idct(dct(blocks)), blocks, atol=2e-6, rtol=1e-5)
    constant = torch.full((1, 8, 8), 3.0)  # all energy in the DC coefficient
    torch.testing.assert_close(dct(constant)[0, 0, 0], torch.tensor(24.0))
    assert dct(constant).flatten()[1:].abs().max() < 1e-5


@pytest.mark.parametrize("encoding", ["topk", "dct"])
def test_keeping_every_value_round_trips_partial_chunks(encoding):
    values = torch.randn(96, 100)
    result = _encode(encoding, values, topk=64 * 64, value_dtype="float32")
    torch.testing.assert_close(decode(result), values, atol=2e-6, rtol=1e-5)


def test_topk_keeps_the_k_largest_magnitudes_of_each_chunk():
    values = torch.randn(96, 100)
    result = _encode("topk", values, topk=10, value_dtype="float32")
    grid = ChunkGrid.of(SHAPE, 64)
    blocks = grid.blocks(values, TIER1).reshape(4, -1)
    for row, block in enumerate(blocks):
        largest = set(block.abs().topk(10).indices.tolist())
        assert set(result.indices[row].tolist()) == largest
        assert torch.equal(result.values[row], block[result.indices[row]])
    kept = torch.zeros_like(blocks).scatter(1, result.indices, result.values)
    assert torch.equal(decode(result), grid.assemble(kept.reshape(4, 64, 64), TIER1))


def test_dct_keeps_the_k_largest_coefficients():
    values = torch.randn(96, 100)
    result = _encode("dct", values, topk=32, value_dtype="float32")
    grid = ChunkGrid.of(SHAPE, 64)
    coefficients = dct(grid.blocks(values, TIER1)).reshape(4, -1)
    keep = coefficients.abs().topk(32, dim=1).indices
    assert torch.equal(result.indices.sort(dim=1).values, keep.sort(dim=1).values)
    kept = torch.zeros_like(coefficients).scatter(1, keep, coefficients.gather(1, keep))
    expected = grid.assemble(idct(kept.reshape(4, 64, 64)), TIER1)
    torch.testing.assert_close(decode(result), expected)


def test_values_travel_in_the_configured_dtype():
    values = torch.randn(96, 100)
    assert _encode("dct", values).values.dtype == torch.bfloat16  # the default
    assert _encode("topk", values, value_dtype="float16").values.dtype == torch.float16
    assert _encode("dense", values, value_dtype="float16").values.dtype == torch.float32


def test_dense_with_no_decay_sends_exactly_lr_times_the_gradient():
    compressor = CompressionConfig(encoding="dense", decay=0.0, lr=0.37).build()
    state = compressor.feedback("w", SHAPE, TIER1)
    for _ in range(3):
        grad = torch.randn(96, 100)
        sent = state.step(grad, tokens=11)
        assert torch.equal(decode(sent), 0.37 * grad)
        assert not state.momentum.any()
    assert (sent.encoding, sent.region, sent.tokens, sent.shape) == ("dense", TIER1, 11, SHAPE)


@pytest.mark.parametrize("encoding", ["topk", "dct"])
def test_error_feedback_keeps_what_was_not_sent(encoding):
    # β = 1: what was sent over the rounds plus the residual is the sum of the inputs.
    state = CompressionConfig(encoding=encoding, decay=1.0, lr=0.5, topk=8).build().feedback(
        "w", SHAPE, TIER1
    )
    grads = [torch.randn(96, 100) for _ in range(4)]
    sent = sum(decode(state.step(grad, tokens=1)) for grad in grads)
    assert sent.abs().sum() < 0.5 * (0.5 * sum(grads)).abs().sum()  # most is still held back
    torch.testing.assert_close(sent + state.momentum, 0.5 * sum(grads), atol=1e-5, rtol=1e-5)


def test_error_feedback_with_decay_discounts_older_rounds():
    state = CompressionConfig(decay=0.9, lr=2.0).build().feedback("w", SHAPE, TIER1)
    grads = [torch.randn(96, 100) for _ in range(3)]
    sent = [decode(state.step(grad, tokens=1)) for grad in grads]
    # m_R + Σ β^(R-r) sent_r = Σ β^(R-r) lr g_r
    left = state.momentum + sum(0.9 ** (2 - r) * s for r, s in enumerate(sent))
    right = sum(0.9 ** (2 - r) * 2.0 * g for r, g in enumerate(grads))
    torch.testing.assert_close(left, right, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("settings", "error", "message"),
    [
        ({"encoding": "dtc"}, UnknownEncoding, "did you mean 'dct'"),
        ({"chunk": 0}, CompressionConfigError, r"chunk must lie in \[1, 4294967295\]"),
        ({"topk": 0}, CompressionConfigError, "topk must be >= 1"),
        ({"decay": 1.5}, CompressionConfigError, "decay must lie in"),
        ({"lr": 0.0}, CompressionConfigError, r"lr must lie in \(0, 10.0\]"),
        ({"value_dtype": "int3"}, CompressionConfigError, "value_dtype 'int3' is not one of"),
        ({"encoding": "dense", "value_dtype": "int4"}, CompressionConfigError,
         "value_dtype int4 quantizes each chunk's kept values, so it needs encoding topk"),
    ],
)
def test_bad_settings_are_named_errors(settings, error, message):
    with pytest.raises(error, match=message):
        CompressionConfig(**settings)


def test_wire_counts_indices_at_the_smallest_integer_type():
    assert index_dtype(64) == torch.int8  # positions in a 64-long 1-D chunk
    assert index_dtype(128) == torch.int8
    assert index_dtype(129) == torch.int16
    assert index_dtype(64 * 64) == torch.int16  # positions in a 64 x 64 chunk
    assert index_dtype(2**16) == torch.int32
    values = torch.randn(128, 128)
    result = CompressionConfig().build().encode(
        "w", values, shape=(128, 128), region=full_region((128, 128)), tokens=1
    )
    assert payload_bytes(result) == 4 * 1 + 4 * 32 * 2 + 4 * 32 * 2  # ids, positions, bf16
    dense = CompressionConfig(encoding="dense").build().encode(
        "w", values, shape=(128, 128), region=full_region((128, 128)), tokens=1
    )
    assert payload_bytes(dense) == 128 * 128 * 4
