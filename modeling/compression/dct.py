"""Orthonormal DCT-II over chunks, as DeMo compresses momentum.

The transform along a dimension of size n is the matrix D (n, n) with
D[k, i] = s_k · cos(π (2i + 1) k / 2n), s_0 = √(1/n), s_k = √(2/n); it is orthonormal, so its
inverse is Dᵀ and a chunk round-trips to fp32 round-off. A chunk is transformed along each of
its dimensions in turn (separable), which for a 2-D chunk X is D₀ X D₁ᵀ.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor


@functools.cache
def dct_matrix(n: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The (n, n) orthonormal DCT-II matrix, computed in float64 and cached."""
    i = torch.arange(n, dtype=torch.float64)
    matrix = torch.cos(math.pi * (2 * i[None, :] + 1) * i[:, None] / (2 * n))
    matrix[0] *= math.sqrt(1 / n)
    matrix[1:] *= math.sqrt(2 / n)
    return matrix.to(dtype)


def dct(blocks: Tensor) -> Tensor:
    """(n, *chunk) chunks → their DCT-II coefficients, same shape."""
    return _along_chunk_dims(blocks, inverse=False)


def idct(coefficients: Tensor) -> Tensor:
    """Inverse of ``dct``: (n, *chunk) coefficients → chunks."""
    return _along_chunk_dims(coefficients, inverse=True)


def _along_chunk_dims(blocks: Tensor, *, inverse: bool) -> Tensor:
    out = blocks
    for dim in range(1, blocks.ndim):
        matrix = dct_matrix(blocks.shape[dim], blocks.dtype).to(blocks.device)
        # x @ Dᵀ transforms the last dimension; x @ D applies the inverse
        out = (out.movedim(dim, -1) @ (matrix if inverse else matrix.T)).movedim(-1, dim)
    return out


# The broadcast's exact inverse. Levels are integers of magnitude <= LEVEL_MAX and the
# integer DCT matrix is round(D·2^bits): every product and partial sum of the inverse is then
# an integer below 2^53, which float64 holds exactly, so the result has the same bits in any
# summation order, on any machine, BLAS and thread count (docs/architecture.md, "The update
# record").
LEVEL_MAX = 127  # int8 levels
_EXACT = 2**53


def exact_bits(chunk: tuple[int, ...]) -> int:
    """Fraction bits of the integer DCT matrices for ``chunk``: the most (up to 20) that keep
    every sum of the inverse below 2^53."""
    numel = math.prod(chunk)
    bits = 20
    while bits > 0 and numel * LEVEL_MAX * 2 ** (bits * len(chunk)) >= _EXACT:
        bits -= 1
    return bits


@functools.cache
def integer_dct_matrix(n: int, bits: int) -> Tensor:
    """round(D·2^bits) for the (n, n) DCT-II matrix, as float64 integers."""
    return torch.round(dct_matrix(n, torch.float64) * 2.0**bits)


def exact_idct(levels: Tensor, bits: int) -> Tensor:
    """(n, *chunk) integer levels (any dtype) → their inverse transform times 2^(bits·ndim),
    float64 integers with the same bits everywhere; divide by that power for the values."""
    out = levels.to(torch.float64)
    for dim in range(1, levels.ndim):
        matrix = integer_dct_matrix(levels.shape[dim], bits).to(levels.device)
        out = (out.movedim(dim, -1) @ matrix).movedim(-1, dim)
    return out
