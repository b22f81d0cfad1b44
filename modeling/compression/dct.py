"""Orthonormal DCT-II over chunks, as DeMo compresses momentum.

The transform along a dimension of size n is the matrix D (n, n) with
D[k, i] = s_k · cos(π (2i + 1) k / 2n), s_0 = √(1/n), s_k = √(2/n); it is orthonormal, so its
inverse is Dᵀ and a chunk round-trips to fp32 round-off. A chunk is transformed along each of
its dimensions in turn (separable), which for a 2-D chunk X is D₀ X D₁ᵀ.

Chunks are transformed where they lie (``chunkwise``): a tensor whose every dimension is a
whole number of chunks keeps its layout, each chunk's coefficients in place of its values.
Along a dimension that is one matrix product over the whole tensor, with no copy into a stack
of chunks and back; a stack of chunks (n, *chunk) is the same thing with n chunks along its
first dimension.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

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


def chunkwise(values: Tensor, chunk: Sequence[int], matrices: Sequence[Tensor | None]
              ) -> Tensor:
    """``values`` with every chunk ``x`` replaced by ``M x`` along each dimension d (index i of
    the result is Σ_j M[i, j] x[j]; ``matrices[d]``, None: left as it is). Every dimension of
    ``values`` must be a whole number of chunks."""
    out = values
    for dim, (size, matrix) in enumerate(zip(chunk, matrices, strict=True)):
        if matrix is None:
            continue
        shape = out.shape
        matrix = matrix.to(out.device)
        inner = math.prod(shape[dim + 1:])
        if inner == 1:  # the last dimension: rows of one chunk each, times Mᵀ
            out = (out.reshape(-1, size) @ matrix.T).reshape(shape)
        else:  # M times each (size, inner) block: one batched product, nothing moved
            out = torch.matmul(matrix, out.reshape(-1, size, inner)).reshape(shape)
    return out


def chunkwise_dct(values: Tensor, chunk: Sequence[int]) -> Tensor:
    """The DCT-II of every chunk of ``values``, each chunk's coefficients where it lies."""
    return chunkwise(values, chunk, [dct_matrix(n, values.dtype) for n in chunk])


def chunkwise_idct(coefficients: Tensor, chunk: Sequence[int]) -> Tensor:
    """Inverse of ``chunkwise_dct``."""
    return chunkwise(coefficients, chunk, [dct_matrix(n, coefficients.dtype).T for n in chunk])


def stacked(transform: Callable[[Tensor, tuple[int, ...]], Tensor], blocks: Tensor) -> Tensor:
    """A chunkwise ``transform`` of each of (n, *chunk) stacked chunks (n chunks along the
    first dimension are a chunkwise layout too), same shape."""
    chunk = tuple(blocks.shape[1:])
    return transform(blocks.reshape(-1, *chunk[1:]), chunk).reshape(blocks.shape)


def dct(blocks: Tensor) -> Tensor:
    """(n, *chunk) chunks → their DCT-II coefficients, same shape."""
    return stacked(chunkwise_dct, blocks)


def idct(coefficients: Tensor) -> Tensor:
    """Inverse of ``dct``: (n, *chunk) coefficients → chunks."""
    return stacked(chunkwise_idct, coefficients)


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
    def inverse(values: Tensor, chunk: tuple[int, ...]) -> Tensor:
        return chunkwise(values, chunk, [integer_dct_matrix(n, bits).T for n in chunk])

    return stacked(inverse, levels.to(torch.float64))


def row_order(rows: Tensor, count: int) -> tuple[Tensor, Tensor]:
    """For levels at ``rows`` (1-D; the levels of one row adjacent, as each chunk's positions
    in order leave them), the order that puts them row by row and where each of the
    ``count`` rows begins in it: each row's run of levels moves, in one piece, to where the
    rows before it end (a block of rows is then one slice of the levels)."""
    counts = torch.bincount(rows, minlength=count)
    starts = counts.cumsum(0) - counts
    index = torch.arange(len(rows), device=rows.device)
    begins = torch.ones_like(rows, dtype=torch.bool)
    begins[1:] = rows[1:] != rows[:-1]
    run = torch.where(begins, index, 0).cummax(0).values  # where each level's run begins
    order = torch.empty_like(index)
    order[starts[rows] + index - run] = index
    return order, starts


class SparseExactDecoder:
    """``exact_idct`` of blocks of chunks given by their nonzero levels, one block after
    another, into memory it keeps: a block is a tensor of whole chunks laid out chunkwise,
    seen as rows of one chunk's last dimension (``view(-1, chunk[-1])``), and each level
    lies at a row and a column of it. Along the last dimension a row is the sum of its
    levels times their matrix rows (k per chunk instead of a dense product); every partial
    sum is still a sum of the chunk's level × matrix products, so it stays an integer below
    2^53 and the bits are ``exact_idct``'s in any order. A block's result is valid until the
    next call: new pages for every block would cost more than the arithmetic."""

    def __init__(self, chunk: Sequence[int], bits: int, device: torch.device) -> None:
        self.chunk, self.bits, self.device = tuple(chunk), bits, device
        self.matrices = [integer_dct_matrix(n, bits).to(device) for n in self.chunk]
        self._memory: dict[str, Tensor] = {}

    def __call__(self, levels: Tensor, columns: Tensor, rows: Tensor, shape: Sequence[int]
                 ) -> Tensor:
        """The float64 block of ``shape`` (integers · 2^(bits·ndim)) of ``levels`` at
        ``rows`` and ``columns`` (each 1-D, one entry per level)."""
        last = self.chunk[-1]
        terms = self._take("terms", (len(levels), last))
        torch.index_select(self.matrices[-1], 0, columns, out=terms)
        terms.mul_(levels.to(torch.float64).unsqueeze(1))
        along_last = self._take("rows", (math.prod(shape) // last, last)).zero_()
        along_last.index_add_(0, rows, terms)
        if len(self.chunk) == 1:
            return along_last.view(*shape)
        if len(self.chunk) == 2:
            out = self._take("out", tuple(shape))
            torch.matmul(self.matrices[0].T, along_last.view(-1, self.chunk[0], shape[1]),
                         out=out.view(-1, self.chunk[0], shape[1]))
            return out
        return chunkwise(along_last.view(*shape), self.chunk,
                         [*(m.T for m in self.matrices[:-1]), None])

    def _take(self, name: str, shape: tuple[int, ...]) -> Tensor:
        """A float64 tensor of ``shape`` in the memory kept under ``name``, grown as needed."""
        numel = math.prod(shape)
        kept = self._memory.get(name)
        if kept is None or kept.numel() < numel:
            kept = self._memory[name] = torch.empty(numel, dtype=torch.float64,
                                                    device=self.device)
        return kept[:numel].view(shape)
