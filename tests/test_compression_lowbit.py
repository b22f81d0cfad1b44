"""Low-bit values ([compression] value_dtype int2 / int4 / int8, issue 49): each chunk's kept
values as codes of that many bits and a float32 scale; the error feedback keeps the rounding;
the wire carries the codes packed and the receiver rebuilds the values bit for bit. And the
broadcast's levels of [update] broadcast_bits 4 or 2, packed on the wire."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.helpers import checked_tables

from matformer.modeling.compression import CompressionConfig, payload_bytes
from matformer.modeling.compression.encodings import decode
from matformer.modeling.compression.quantize import QUANTIZED_BITS, code_range, codes_of, quantize
from matformer.modeling.compression.steps import Broadcast
from matformer.modeling.errors import CompressionConfigError
from matformer.protocol.errors import LayoutMismatch, MalformedSparseResult, MalformedStream
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.sparse import decode_sparse_result, encode_sparse_result, result_layouts
from matformer.protocol.tensors import encode_tensor
from matformer.protocol.updates import decode_step, encode_step
from matformer.server.config import RunConfig
from matformer.server.errors import InvalidValue

NAME = "model.layers.0.mlp.up_proj.weight"
SHAPE = (200, 130)  # a partial edge chunk in both dimensions under chunk 64
REGION = ((0, 200), (0, 100))


def encoded(value_dtype: str, seed: int = 0, **settings):
    compressor = CompressionConfig(value_dtype=value_dtype, **settings).build()
    values = torch.randn(200, 100, generator=torch.Generator().manual_seed(seed))
    return compressor, compressor.encode(NAME, values, shape=SHAPE, region=REGION, tokens=7)


def layout_of(compressor):
    return result_layouts(compressor, {NAME: SHAPE}, {NAME: REGION})[NAME]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_values_stand_on_half_integer_levels_with_the_largest_kept(bits):
    kept = torch.randn(50, 32, generator=torch.Generator().manual_seed(bits))
    kept[3] = 0.0  # a chunk of zeros: scale 0, values 0
    values, scales = quantize(kept, bits)
    low, high = code_range(bits)
    codes = codes_of(values, scales, bits)
    assert int(codes.min()) >= low and int(codes.max()) <= high
    assert torch.equal(values, (codes.float() + 0.5) * scales[:, None])  # on the levels
    assert scales[3] == 0 and not values[3].any()
    largest = kept.abs().amax(dim=1)
    assert torch.allclose(values.abs().amax(dim=1), largest, rtol=1e-6)
    # each value goes to the nearest level: within half a step of it
    others = torch.arange(50) != 3
    step = (kept - values)[others] / scales[others, None]
    assert float(step.abs().max()) <= 0.5 + 1e-5
    if bits == 2:  # two bits: ±0.5 and ±1.5 scales
        assert set((values[others] / scales[others, None]).round(decimals=4).unique().tolist()) \
            <= {-1.5, -0.5, 0.5, 1.5}


@pytest.mark.parametrize("value_dtype", sorted(QUANTIZED_BITS))
def test_the_wire_carries_codes_and_scales_and_gives_the_values_back_bit_for_bit(value_dtype):
    compressor, result = encoded(value_dtype)
    assert result.value_bits == QUANTIZED_BITS[value_dtype] and result.values.dtype == torch.float32
    message = encode_sparse_result(result)
    n, k = result.indices.shape
    assert (message.values.dtype, list(message.values.shape)) == (
        "uint8", [-(-n * k * result.value_bits // 8)])
    assert (message.scales.dtype, list(message.scales.shape)) == ("float32", [n])
    assert sum(len(t.data) for t in (message.chunks, message.indices, message.values,
                                      message.scales)) == payload_bytes(result)
    back = decode_sparse_result(pb.SparseResult.FromString(message.SerializeToString()),
                                layout_of(compressor))
    assert torch.equal(back.values, result.values) and torch.equal(back.scales, result.scales)
    assert back.value_bits == result.value_bits and torch.equal(back.indices, result.indices)


def test_fewer_bits_send_fewer_bytes_for_the_same_coefficients():
    sizes = {dtype: encode_sparse_result(encoded(dtype)[1]).ByteSize()
             for dtype in ("bfloat16", "int8", "int4", "int2")}
    assert sizes["bfloat16"] > sizes["int8"] > sizes["int4"] > sizes["int2"]


def test_the_error_feedback_keeps_the_rounding_for_later_rounds():
    """With no decay, what was sent over rounds plus the momentum left is exactly the sum of
    the inputs: nothing the codes round away is lost."""
    compressor = CompressionConfig(value_dtype="int2", decay=1.0).build()
    feedback = compressor.feedback(NAME, SHAPE, REGION)
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(200, 100, generator=generator) for _ in range(4)]
    sent = sum(decode(feedback.step(g, tokens=7)) for g in inputs)
    assert torch.allclose(sent + feedback.momentum, sum(inputs), atol=1e-4)


@pytest.mark.parametrize("change, error, match", [
    (lambda m: m.ClearField("scales"), LayoutMismatch, "one float32 scale per chunk"),
    (lambda m: m.scales.CopyFrom(encode_tensor(torch.ones(3))), LayoutMismatch,
     "one float32 scale per chunk"),
    (lambda m: m.values.CopyFrom(encode_tensor(torch.zeros(5, dtype=torch.uint8))),
     LayoutMismatch, "4-bit values"),
    (lambda m: m.scales.CopyFrom(encode_tensor(-torch.ones(m.scales.shape[0]))),
     MalformedSparseResult, "scales must be finite and >= 0"),
    (lambda m: m.scales.CopyFrom(encode_tensor(torch.full((m.scales.shape[0],), torch.nan))),
     MalformedSparseResult, "scales must be finite and >= 0"),
])
def test_low_bit_results_off_the_layout_are_refused(change, error, match):
    compressor, result = encoded("int4")
    message = encode_sparse_result(result)
    change(message)
    with pytest.raises(error, match=match):
        decode_sparse_result(message, layout_of(compressor))


def test_a_run_of_one_kind_of_values_refuses_the_other():
    low, result = encoded("int4")
    plain, other = encoded("bfloat16")
    with pytest.raises(LayoutMismatch, match="has scales"):
        decode_sparse_result(encode_sparse_result(result), layout_of(plain))
    with pytest.raises(LayoutMismatch, match="4-bit values"):
        decode_sparse_result(encode_sparse_result(other), layout_of(low))
    relayed = dataclasses.replace(result, value_bits=0, scales=None)  # float32, no codes
    with pytest.raises(LayoutMismatch):
        decode_sparse_result(encode_sparse_result(relayed), layout_of(low))


@pytest.mark.parametrize("bits, most", [(8, 127), (4, 7), (2, 1)])
def test_broadcast_levels_of_fewer_bits_travel_packed_and_decode_the_same(bits, most):
    values = torch.randn(200, 130, generator=torch.Generator().manual_seed(bits))
    step, _, _ = Broadcast(topk=48, chunk=64, bits=bits).encode(values, [((0, 200), (0, 130))],
                                                               None)
    assert int(step.levels.abs().max()) == most
    message = encode_step(NAME, step)
    assert message.coefficients.level_bits == (0 if bits == 8 else bits)
    _, back = decode_step(pb.ParameterUpdate.FromString(message.SerializeToString()))
    assert torch.equal(back.levels, step.levels) and torch.equal(back.scales, step.scales)
    assert torch.equal(back.direction(step.box), step.direction(step.box))
    sizes = [encode_step(NAME, Broadcast(topk=48, chunk=64, bits=b).encode(
        values, [((0, 200), (0, 130))], None)[0]).ByteSize() for b in (8, 4, 2)]
    assert sizes[0] > sizes[1] > sizes[2]


@pytest.mark.parametrize("change, match", [
    (lambda c: setattr(c, "level_bits", 3), "levels of 3 bits"),
    (lambda c: setattr(c, "per_chunk", 0), "0 per chunk"),
    (lambda c: c.levels.CopyFrom(encode_tensor(torch.zeros(3, dtype=torch.uint8))), "levels:"),
    (lambda c: c.levels.CopyFrom(encode_tensor(torch.full((c.levels.shape[0],), 255,
                                                          dtype=torch.uint8))),
     "outside \\[-1, 1\\]"),
])
def test_malformed_packed_levels_are_refused(change, match):
    values = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    step, _, _ = Broadcast(topk=8, chunk=64, bits=2).encode(values, [((0, 64), (0, 64))], None)
    message = encode_step(NAME, step)
    change(message.coefficients)
    with pytest.raises(MalformedStream, match=match):
        decode_step(message)


def test_broadcast_bits_are_one_of_those_the_wire_packs():
    assert RunConfig.from_dict(checked_tables()).update.broadcast_bits == 8
    with pytest.raises(InvalidValue, match=r"\[update\] broadcast_bits"):
        RunConfig.from_dict(checked_tables(update={"broadcast_bits": 3}))
    with pytest.raises(CompressionConfigError, match="broadcast levels take 8, 4, 2 bits"):
        Broadcast(topk=8, chunk=64, bits=1)
