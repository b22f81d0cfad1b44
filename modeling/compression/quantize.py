"""Low-bit values: each chunk's kept values as ``bits``-bit codes and one float32 scale.

Code ``q`` in ``[-2**(bits-1), 2**(bits-1) - 1]`` stands for ``(q + 0.5) · scale``: the
levels are the half-integers of the scale, every code is used (two bits: ±0.5 and ±1.5
scales), and ``scale = absmax / (2**(bits-1) - 0.5)`` puts the chunk's largest value on the
outermost level. Each value goes to the nearest level: ``q = floor(v / scale)``, clamped.

The encoder keeps the dequantized values in the result (``SparseResult.values``, float32)
with their scales, so the error feedback subtracts exactly what was sent and keeps the
rounding error for a later round; the wire carries the codes, ``bits`` each
(``wire.pack_bits`` of ``code - low``), and the scales, and the receiver rebuilds the same
float32 values bit for bit (``dequantize``: the same product in the same dtype).
"""

from __future__ import annotations

import torch
from torch import Tensor

# value_dtype names ([compression]) that send codes of this many bits with a scale per chunk
QUANTIZED_BITS = {"int2": 2, "int4": 4, "int8": 8}


def code_range(bits: int) -> tuple[int, int]:
    """The smallest and largest code of ``bits`` bits."""
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def quantize(kept: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """``kept`` (n, k) float values → (the float32 values the codes stand for, (n,) float32
    scales). A row of zeros gets scale 0 and values 0."""
    kept = kept.float()
    high = code_range(bits)[1]
    scales = kept.abs().amax(dim=1) / (high + 0.5) if kept.shape[1] else kept.new_zeros(len(kept))
    codes = codes_of(kept, scales, bits)
    return dequantize(codes, scales), scales


def codes_of(values: Tensor, scales: Tensor, bits: int) -> Tensor:
    """The int8 codes of ``values`` (n, k) under ``scales`` (n,): ``floor(v / scale)``,
    clamped; for values that already stand on levels, the level each stands on (v / scale
    is then within rounding of q + 0.5)."""
    low, high = code_range(bits)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))[:, None]
    codes = torch.floor(values.float() / safe)
    codes = torch.where(scales[:, None] > 0, codes, torch.zeros_like(codes))
    return codes.clamp(low, high).to(torch.int8)


def dequantize(codes: Tensor, scales: Tensor) -> Tensor:
    """The float32 values ``codes`` (n, k) stand for under ``scales`` (n,)."""
    return (codes.float() + 0.5) * scales.float()[:, None]
