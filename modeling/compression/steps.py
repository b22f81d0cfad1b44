"""One parameter's update in the one form it is logged, sent and applied
(docs/architecture.md, "The update record").

A step holds a *direction* over the universal shape and the regions it *covers*; the update
rule moves covered elements along the direction (``update.py``). Two forms:

- ``DenseStep``: the direction as it is over the box holding every covered element: the
  exact float32 aggregate, or its int8 signs when the rule reads nothing else.
- ``CoefficientStep``: per chunk of that box, the k largest DCT coefficients of the
  aggregate as int8 levels with one float32 scale per chunk. It decodes with integer
  arithmetic that float64 holds exactly (``dct.exact_idct``), so every replica and the
  coordinator's master get the same bits on any machine. Its size is k per chunk whatever
  the number of clients; the coordinator carries what it left out to the next round
  (``Coordinator.residual``).

``cut(region)`` gives what a client holding ``region`` needs (a tier downloads only that),
and ``direction(region)``/``mask(region)`` are the same numbers whatever was cut first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from modeling.compression.dct import LEVEL_MAX, dct, exact_bits, exact_idct
from modeling.compression.grid import ChunkGrid, Region, region_shape, region_slices
from modeling.errors import CompressionConfigError, RegionError

MIN_EXACT_BITS = 8  # fraction bits below this would make the integer DCT a poor inverse


def intersect(a: Region, b: Region) -> Region | None:
    """The box both regions hold, None if they share no element."""
    box = tuple((max(s0, s1), min(e0, e1)) for (s0, e0), (s1, e1) in zip(a, b, strict=True))
    return box if all(start < stop for start, stop in box) else None


def bounding_box(regions: Sequence[Region]) -> Region:
    """The smallest box holding every region."""
    return tuple((min(r[d][0] for r in regions), max(r[d][1] for r in regions))
                 for d in range(len(regions[0])))


def _within(inner: Region, outer: Region) -> tuple[slice, ...]:
    """Index an ``outer``-shaped tensor with this to get ``inner`` (which lies inside it)."""
    return tuple(slice(s - o, e - o) for (s, e), (o, _) in zip(inner, outer, strict=True))


def _mask(covered: tuple[Region, ...], region: Region) -> Tensor:
    mask = torch.zeros(region_shape(region), dtype=torch.bool)
    for box in covered:
        inside = intersect(box, region)
        if inside is not None:
            mask[_within(inside, region)] = True
    return mask


def _cut_covered(covered: tuple[Region, ...], region: Region) -> tuple[Region, ...]:
    return tuple(box for box in (intersect(c, region) for c in covered) if box is not None)


@dataclass(frozen=True, slots=True)
class DenseStep:
    shape: tuple[int, ...]  # the parameter's universal shape
    covered: tuple[Region, ...]  # boxes whose union is updated; nothing else moves
    box: Region  # bounding box of covered: where values lie
    # box-shaped: float32 direction (float64 in a float64 dense run), or int8 signs (-1, 0, 1)
    values: Tensor

    def direction(self, region: Region) -> Tensor:
        """Region-shaped float32 direction, float64 if the values are (0 outside the box)."""
        dtype = torch.float64 if self.values.dtype == torch.float64 else torch.float32
        out = torch.zeros(region_shape(region), dtype=dtype, device=self.values.device)
        inside = intersect(self.box, region)
        if inside is not None:
            out[_within(inside, region)] = self.values[_within(inside, self.box)].to(dtype)
        return out

    def mask(self, region: Region) -> Tensor:
        """Region-shaped bool: the elements this step updates."""
        return _mask(self.covered, region).to(self.values.device)

    def cut(self, region: Region) -> DenseStep | None:
        """What a holder of ``region`` needs; None if the step covers nothing there."""
        covered = _cut_covered(self.covered, region)
        if not covered:
            return None
        box = bounding_box(covered)
        return DenseStep(shape=self.shape, covered=covered, box=box,
                         values=self.values[_within(box, self.box)])

    @property
    def nbytes(self) -> int:
        return self.values.numel() * self.values.element_size()


@dataclass(frozen=True, slots=True)
class CoefficientStep:
    shape: tuple[int, ...]
    covered: tuple[Region, ...]
    box: Region  # starts on the chunk grid; rows are the chunks it touches
    chunk: tuple[int, ...]  # chunk shape on the universal grid
    positions: Tensor  # (n, k) int64 positions inside each chunk, rows in chunk_ids(box) order
    levels: Tensor  # (n, k) int8 in [-LEVEL_MAX, LEVEL_MAX]
    scales: Tensor  # (n,) float32: a coefficient is level · scale

    @property
    def grid(self) -> ChunkGrid:
        return ChunkGrid(shape=self.shape, chunk=self.chunk)

    def direction(self, region: Region) -> Tensor:
        """Region-shaped float32 direction: the kept coefficients' inverse DCT, exact."""
        out = torch.zeros(region_shape(region), device=self.levels.device)
        inside = intersect(self.box, region)
        if inside is None:
            return out
        grid = self.grid
        rows = grid.locate(grid.chunk_ids(inside), self.box)  # every chunk lies inside the box
        levels = torch.zeros((len(rows), grid.chunk_numel), dtype=torch.float64,
                             device=out.device)
        levels.scatter_(1, self.positions[rows], self.levels[rows].to(torch.float64))
        bits = exact_bits(self.chunk)
        scaled = exact_idct(levels.reshape(-1, *self.chunk), bits)  # integers · 2^(bits·ndim)
        factor = self.scales[rows].to(torch.float64) / 2.0 ** (bits * len(self.chunk))
        values = (scaled * factor.reshape(-1, *([1] * len(self.chunk)))).float()
        out[_within(inside, region)] = grid.assemble(values, inside)
        return out

    def mask(self, region: Region) -> Tensor:
        return _mask(self.covered, region).to(self.levels.device)

    def cut(self, region: Region) -> CoefficientStep | None:
        covered = _cut_covered(self.covered, region)
        if not covered:
            return None
        box = bounding_box(covered)
        grid = self.grid
        rows = grid.locate(grid.chunk_ids(box), self.box)
        return CoefficientStep(shape=self.shape, covered=covered, box=box, chunk=self.chunk,
                               positions=self.positions[rows], levels=self.levels[rows],
                               scales=self.scales[rows])

    @property
    def nbytes(self) -> int:
        """Bytes of levels, scales and positions packed to the bits a position needs."""
        bits = max(1, math.ceil(math.log2(self.grid.chunk_numel)))
        packed = -(-self.positions.numel() * bits // 8)
        return self.levels.numel() + 4 * self.scales.numel() + packed


Step = DenseStep | CoefficientStep


def dense_step(values: Tensor, covered: Sequence[Region], *, signs: bool) -> DenseStep:
    """The exact step of a universal-shaped aggregate ``values`` over ``covered``; ``signs``:
    keep only its signs (for a rule that reads nothing else), 1 byte per element."""
    covered = tuple(sorted(set(covered)))
    box = bounding_box(covered)
    inside = values[region_slices(box)]
    if signs:
        inside = inside.sign().to(torch.int8)
    else:  # float64 stays float64: a float64 dense run's exact step
        inside = inside.clone() if inside.dtype == torch.float64 else inside.float().clone()
    return DenseStep(shape=tuple(values.shape), covered=covered, box=box, values=inside)


@dataclass(frozen=True, slots=True)
class Broadcast:
    """How the coordinator compresses an aggregate for its broadcast: ``topk`` DCT
    coefficients per chunk of ``chunk`` (clipped to smaller dimensions)."""

    topk: int
    chunk: int

    def __post_init__(self) -> None:
        if self.topk < 1 or self.chunk < 1:
            raise CompressionConfigError(
                f"a compressed broadcast needs topk >= 1 and chunk >= 1, got {self.topk} and "
                f"{self.chunk}.")

    def check(self, shape: Sequence[int]) -> None:
        """Raise CompressionConfigError if a parameter of ``shape`` cannot be decoded exactly
        with integer arithmetic (chunks of more than two dimensions, very large chunks)."""
        chunk = ChunkGrid.of(shape, self.chunk).chunk
        if exact_bits(chunk) < MIN_EXACT_BITS:
            raise CompressionConfigError(
                f"a chunk of shape {chunk} is too large for the exact broadcast decode "
                f"(needs {MIN_EXACT_BITS} fraction bits within float64); lower [compression] "
                "chunk, or set [update] broadcast_topk = 0 for an uncompressed broadcast.")

    def encode(self, values: Tensor, covered: Sequence[Region], residual: Tensor | None
               ) -> tuple[CoefficientStep, Tensor, Tensor]:
        """The step for a universal-shaped aggregate ``values`` over ``covered``, with
        ``residual`` (what earlier broadcasts left out, universal shape; None: nothing) added
        on covered elements first. Returns the step, the new residual (a new tensor: what it
        left out, where covered; the old residual elsewhere) and the step's direction over
        its box (``step.direction(step.box)``, computed here anyway)."""
        covered = tuple(sorted(set(covered)))
        grid = ChunkGrid.of(values.shape, self.chunk)
        box = bounding_box(covered)
        try:
            grid.check_region(box)
        except RegionError as err:
            raise CompressionConfigError(f"cannot broadcast this update: {err}") from None
        where = region_slices(box)
        mask = _mask(covered, box).to(values.device)
        pending = values[where].float()
        if residual is not None:
            pending = pending + torch.where(mask, residual[where], 0.0)
        flat = dct(grid.blocks(pending, box)).reshape(-1, grid.chunk_numel)  # (n, chunk_numel)
        positions = flat.abs().topk(min(self.topk, grid.chunk_numel), dim=1).indices
        kept = flat.gather(1, positions)
        scales = kept.abs().amax(dim=1) / LEVEL_MAX  # float32, 0 for an all-zero chunk
        levels = torch.where(scales[:, None] > 0, kept / scales[:, None].clamp_min(1e-38), 0.0)
        step = CoefficientStep(
            shape=tuple(values.shape), covered=covered, box=box, chunk=grid.chunk,
            positions=positions, scales=scales,
            levels=levels.round().clamp(-LEVEL_MAX, LEVEL_MAX).to(torch.int8))
        decoded = step.direction(box)
        left = torch.zeros_like(values, dtype=torch.float32) if residual is None \
            else residual.clone()
        left[where] = torch.where(mask, pending - decoded, left[where])
        return step, left, decoded
