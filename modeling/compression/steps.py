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
  the number of clients; the coordinator makes it (``Broadcast``) and carries what it left
  out to the next round, as DCT coefficients: when every region behind the aggregate lies on
  the chunk grid, the aggregate arrives as coefficients too, summed where clients sent them,
  and nothing goes back to values but the step's exact decode (``encode_coefficients``).

``cut(region)`` gives what a client holding ``region`` needs (a tier downloads only that),
and ``direction(region)``/``mask(region)`` are the same numbers whatever was cut first.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from matformer.modeling.compression.dct import (
    SparseExactDecoder,
    chunkwise_dct,
    chunkwise_idct,
    exact_bits,
    row_order,
)
from matformer.modeling.compression.grid import (
    ChunkGrid,
    Region,
    full_region,
    region_shape,
    region_slices,
)
from matformer.modeling.errors import CompressionConfigError, RegionError

MIN_EXACT_BITS = 8  # fraction bits below this would make the integer DCT a poor inverse
# Passes over every chunk go a few rows of chunks at a time, with temporaries of about this
# many bytes: they stay in cache and are never handed back to the OS between rows.
BLOCK_BYTES = 8 * 2**20


def intersect(a: Region, b: Region) -> Region | None:
    """The box both regions hold, None if they share no element."""
    box = tuple((max(s0, s1), min(e0, e1)) for (s0, e0), (s1, e1) in zip(a, b, strict=True))
    return box if all(start < stop for start, stop in box) else None


def bounding_box(regions: Sequence[Region]) -> Region:
    """The smallest box holding every region."""
    return tuple((min(r[d][0] for r in regions), max(r[d][1] for r in regions))
                 for d in range(len(regions[0])))


def within(inner: Region, outer: Region) -> tuple[slice, ...]:
    """Index an ``outer``-shaped tensor with this to get ``inner`` (which lies inside it)."""
    return tuple(slice(s - o, e - o) for (s, e), (o, _) in zip(inner, outer, strict=True))


def covered_mask(covered: tuple[Region, ...], region: Region) -> Tensor:
    """Region-shaped bool: True where some box of ``covered`` lies."""
    mask = torch.zeros(region_shape(region), dtype=torch.bool)
    for box in covered:
        inside = intersect(box, region)
        if inside is not None:
            mask[within(inside, region)] = True
    return mask


def _covers(covered: tuple[Region, ...], region: Region) -> bool:
    """Whether one box of ``covered`` holds all of ``region`` (then no mask is needed)."""
    return any(intersect(box, region) == region for box in covered)


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
            out[within(inside, region)] = self.values[within(inside, self.box)].to(dtype)
        return out

    def mask(self, region: Region) -> Tensor:
        """Region-shaped bool: the elements this step updates."""
        return covered_mask(self.covered, region).to(self.values.device)

    def covers(self, region: Region) -> bool:
        """Whether the step updates every element of ``region`` (then no mask is needed)."""
        return _covers(self.covered, region)

    def cut(self, region: Region) -> DenseStep | None:
        """What a holder of ``region`` needs; None if the step covers nothing there."""
        covered = _cut_covered(self.covered, region)
        if not covered:
            return None
        box = bounding_box(covered)
        return DenseStep(shape=self.shape, covered=covered, box=box,
                         values=self.values[within(box, self.box)])

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
    levels: Tensor  # (n, k) int8 in [-LEVEL_MAX, LEVEL_MAX] (or the broadcast's narrower bits)
    scales: Tensor  # (n,) float32: a coefficient is level · scale

    @property
    def grid(self) -> ChunkGrid:
        return ChunkGrid(shape=self.shape, chunk=self.chunk)

    def to(self, device: torch.device | str) -> CoefficientStep:
        """The step with its levels, positions and scales on ``device`` (decoded there)."""
        return replace(self, positions=self.positions.to(device),
                                   levels=self.levels.to(device), scales=self.scales.to(device))

    def direction(self, region: Region) -> Tensor:
        """Region-shaped float32 direction: the kept coefficients' inverse DCT, exact."""
        inside = intersect(self.box, region)
        if inside is None:
            return torch.zeros(region_shape(region), device=self.levels.device)
        values = torch.empty(region_shape(inside), device=self.levels.device)
        for rows, block in self.decoded(inside):
            values[rows].copy_(block)
        if inside == region:
            return values
        out = torch.zeros(region_shape(region), device=values.device)
        out[within(inside, region)] = values
        return out

    def decoded(self, inside: Region) -> Iterator[tuple[slice, Tensor]]:
        """The direction over ``inside`` (a box inside ``self.box``, starting on its chunk
        grid), a few rows of chunks at a time (``BLOCK_BYTES`` of float64 sums): each
        float32 block with the rows of ``inside`` it fills, valid until the next is asked
        for (one block's memory serves them all). A caller that only reads the direction
        block by block (``UpdateRule.apply``) never holds it whole."""
        grid = self.grid
        ids = grid.chunk_ids(inside)
        positions, levels, scales = self.positions, self.levels, self.scales
        if inside != self.box:
            rows = grid.locate(ids, self.box)  # every chunk lies inside the box
            positions, levels, scales = positions[rows], levels[rows], scales[rows]
        if not bool((positions[:, 1:] > positions[:, :-1]).all()):  # not as encode sorts them
            positions, order = positions.sort(dim=1)
            levels = levels.gather(1, order)
        last, bits = self.chunk[-1], exact_bits(self.chunk)
        counts, padded = grid.region_counts(inside), grid.padded(inside)
        shape = region_shape(inside)
        rows = grid.flat_index(inside, ids.unsqueeze(1).to(positions.device), positions) // last
        rows = rows.reshape(-1)
        order, starts = row_order(rows, math.prod(padded) // last)
        rows, columns = rows[order], (positions % last).reshape(-1)[order]
        levels = levels.reshape(-1)[order]
        factor = scales.to(torch.float64) / 2.0 ** (bits * len(self.chunk))
        per_row = math.prod(counts[1:])  # chunks in one row of chunks
        lines = self.chunk[0] * math.prod(padded[1:]) // last  # rows of ``starts`` in one
        marks = [*starts[::lines].tolist(), len(levels)]  # where each row of chunks begins
        height = min(counts[0], max(1, BLOCK_BYTES // (8 * last * lines)))
        crop = tuple(slice(0, n) for n in shape[1:])
        decode = SparseExactDecoder(self.chunk, bits, levels.device)
        work = torch.empty((height * self.chunk[0], *padded[1:]), device=levels.device)
        for top in range(0, counts[0], height):
            bottom = min(counts[0], top + height)
            first, last_level = marks[top], marks[bottom]
            size = (bottom - top) * self.chunk[0]
            scaled = decode(  # integers · 2^(bits·ndim), chunkwise
                levels[first:last_level], columns[first:last_level],
                rows[first:last_level] - top * lines, (size, *padded[1:]))
            block = (bottom - top, *counts[1:])
            pairs = [n for pair in zip(block, self.chunk, strict=True) for n in pair]
            # each chunk times its factor, rounded once in float64, then once to float32
            # (the product is taken in float64 and cast as it is written)
            values = work[:size]
            torch.mul(scaled.view(pairs), factor[top * per_row:bottom * per_row].view(
                [n for c in block for n in (c, 1)]), out=values.view(pairs))
            first_row = top * self.chunk[0]
            last_row = min(shape[0], bottom * self.chunk[0])
            yield slice(first_row, last_row), values[(slice(0, last_row - first_row), *crop)]

    def covers(self, region: Region) -> bool:
        return _covers(self.covered, region)

    def mask(self, region: Region) -> Tensor:
        return covered_mask(self.covered, region).to(self.levels.device)

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


# bits a broadcast level may take: int8 (LEVEL_MAX), 4 bits (±7), 2 bits (-1, 0, 1)
LEVEL_BITS = (8, 4, 2)


@dataclass(frozen=True, slots=True)
class Broadcast:
    """How the coordinator compresses an aggregate for its broadcast: ``topk`` DCT
    coefficients per chunk of ``chunk`` (clipped to smaller dimensions), as levels of
    ``bits`` bits (integers in ``±(2**(bits-1) - 1)``) and a scale per chunk."""

    topk: int
    chunk: int
    bits: int = 8

    def __post_init__(self) -> None:
        if self.topk < 1 or self.chunk < 1:
            raise CompressionConfigError(
                f"a compressed broadcast needs topk >= 1 and chunk >= 1, got {self.topk} and "
                f"{self.chunk}.")
        if self.bits not in LEVEL_BITS:
            raise CompressionConfigError(f"broadcast levels take {', '.join(map(str, LEVEL_BITS))}"
                                         f" bits, not {self.bits}.")

    @property
    def level_max(self) -> int:
        """The largest level's magnitude: 127, 7 or 1 (2 bits: -1, 0, 1)."""
        return (1 << (self.bits - 1)) - 1

    def check(self, shape: Sequence[int]) -> None:
        """Raise CompressionConfigError if a parameter of ``shape`` cannot be decoded exactly
        with integer arithmetic (chunks of more than two dimensions, very large chunks)."""
        chunk = ChunkGrid.of(shape, self.chunk).chunk
        if exact_bits(chunk) < MIN_EXACT_BITS:
            raise CompressionConfigError(
                f"a chunk of shape {chunk} is too large for the exact broadcast decode "
                f"(needs {MIN_EXACT_BITS} fraction bits within float64); lower [compression] "
                "chunk, or set [update] broadcast_topk = 0 for an uncompressed broadcast.")

    def on_grid(self, shape: Sequence[int], covered: Sequence[Region]) -> bool:
        """Whether every region of ``covered`` starts and stops on the chunk grid of
        ``shape``: each chunk is then covered whole or not at all and lies inside the shape,
        and ``encode_coefficients`` can take the aggregate as it was summed."""
        chunk = ChunkGrid.of(shape, self.chunk).chunk
        return all(len(region) == len(chunk) and all(
            start % c == 0 and stop % c == 0
            for (start, stop), c in zip(region, chunk, strict=True)) for region in covered)

    def encode(self, values: Tensor, covered: Sequence[Region], residual: Tensor | None
               ) -> tuple[CoefficientStep, Tensor, Tensor]:
        """The step for a universal-shaped aggregate ``values`` over ``covered``, with
        ``residual`` (what earlier broadcasts left out, as ``residual_of`` gives it; None:
        nothing) added on covered elements first. Returns the step, the new residual (a new
        tensor: what it left out, where covered; the old residual elsewhere) and the step's
        direction over its box (``step.direction(step.box)``, computed here anyway).

        Element by element, in the values' domain: a region may end inside a chunk or the
        shape, so the residual is taken back to values over the box's chunks and
        transformed again after."""
        covered = tuple(sorted(set(covered)))
        grid, box = self._grid(values.shape, covered)
        hull, inner = _hull(grid, box), region_slices(full_region(region_shape(box)))
        mask = covered_mask(covered, box).to(values.device)
        pending = values[region_slices(box)].float()
        if residual is None:
            left = torch.zeros(grid.padded(box), device=values.device)
        else:
            left = chunkwise_idct(residual[hull], grid.chunk)  # values over the box's chunks
            pending = pending + torch.where(mask, left[inner], 0.0)
        padded = torch.zeros_like(left)
        padded[inner] = pending
        step = self._step(chunkwise_dct(padded, grid.chunk), grid, box, covered)
        decoded = step.direction(box)
        left[inner] = torch.where(mask, pending - decoded, left[inner])
        for dim, ((start, _), size) in enumerate(zip(box, grid.shape, strict=True)):
            end = size - start  # where the shape ends in the box's chunks: zeros after it
            if end < left.shape[dim]:
                left.narrow(dim, end, left.shape[dim] - end).zero_()
        out = self._residual(grid, residual, values.device)
        out[hull] = chunkwise_dct(left, grid.chunk)
        return step, out, decoded

    def encode_coefficients(self, coefficients: Tensor, shape: Sequence[int],
                            covered: Sequence[Region], residual: Tensor | None
                            ) -> tuple[CoefficientStep, Tensor]:
        """``encode`` of an aggregate given as its chunkwise DCT over the box of ``covered``
        (``chunkwise_dct`` of its values there; ``on_grid(shape, covered)`` must hold), as
        the coordinator sums it from results. Returns the step and the new residual; the
        step is not decoded here (``UpdateRule.apply`` decodes it block by block as it
        moves the weights). Everything stays in coefficients: the residual is added to
        whole chunks, and what the step left out is the pending coefficients with each kept
        one less what its level and scale carry, a write of k values per chunk.

        That treats the exact decode as the inverse DCT it approximates: its integer
        matrices are the DCT's rounded to ``exact_bits`` fraction bits (16 for a 64×64
        chunk), so what a replica moves by differs from the kept coefficients' true inverse
        by about 2^-17 of each coefficient, and that difference is not fed back (``encode``
        feeds it back, at the cost of a forward DCT of the whole decode).
        ``coefficients`` is used as working memory."""
        covered = tuple(sorted(set(covered)))
        grid, box = self._grid(shape, covered)
        if not self.on_grid(shape, covered):
            raise CompressionConfigError(
                f"regions {covered} do not lie on the chunk grid {grid.chunk}; encode the "
                "aggregate's values instead.")
        where = region_slices(box)
        pending, old = coefficients, None if residual is None else residual[where]
        counts = grid.region_counts(box)
        chunks = [n for pair in zip(counts, grid.chunk, strict=True) for n in pair]
        spread, whole = self.spread(grid, box, covered, pending.device)
        if old is not None and whole:
            pending.add_(old)
        elif old is not None:
            pending.view(chunks).add_(torch.where(spread, old.reshape(chunks), 0.0))
        step = self._step(pending, grid, box, covered)
        ids = grid.chunk_ids(box).to(pending.device).unsqueeze(1)
        kept = grid.flat_index(box, ids, step.positions).reshape(-1)
        carried = step.levels.float() * step.scales.unsqueeze(1)  # what each kept one carries
        pending.view(-1).index_add_(0, kept, carried.reshape(-1), alpha=-1)
        left = pending
        if not whole:  # chunks of the box that nothing covered keep the old residual
            kept_old = torch.zeros_like(left) if old is None else old
            left = torch.where(spread, left.view(chunks), kept_old.reshape(chunks)).view(
                left.shape)
        if box == full_region(grid.shape):
            return step, left
        out = self._residual(grid, residual, pending.device)
        out[where] = left
        return step, out

    @staticmethod
    def spread(grid: ChunkGrid, box: Region, covered: Sequence[Region],
               device: torch.device) -> tuple[Tensor, bool]:
        """Which chunks of ``box`` some region of ``covered`` holds (regions on the grid),
        as a bool that broadcasts over the box's coefficients viewed chunk by chunk
        (``(n0, c0, n1, c1, ...)``), and whether that is all of them."""
        counts = grid.region_counts(box)
        taken = torch.zeros(grid.size, dtype=torch.bool, device=device)
        for region in covered:
            taken[grid.chunk_ids(region).to(device)] = True
        taken = taken[grid.chunk_ids(box).to(device)]
        return taken.view([n for count in counts for n in (count, 1)]), bool(taken.all())

    def residual_of(self, values: Tensor) -> Tensor:
        """A universal-shaped residual of values as ``encode`` keeps it: the chunkwise DCT of
        its chunks, partial edge chunks padded with zeros (shape ``grid.padded``)."""
        grid = ChunkGrid.of(values.shape, self.chunk)
        padded = values.new_zeros(grid.padded(full_region(grid.shape)), dtype=torch.float32)
        padded[region_slices(full_region(grid.shape))] = values
        return chunkwise_dct(padded, grid.chunk)

    def values_of(self, residual: Tensor, shape: Sequence[int]) -> Tensor:
        """Inverse of ``residual_of``: the universal-shaped values of a residual."""
        grid = ChunkGrid.of(shape, self.chunk)
        return chunkwise_idct(residual, grid.chunk)[region_slices(full_region(grid.shape))]

    def _grid(self, shape: Sequence[int], covered: tuple[Region, ...]
              ) -> tuple[ChunkGrid, Region]:
        grid = ChunkGrid.of(shape, self.chunk)
        box = bounding_box(covered)
        try:
            grid.check_region(box)
        except RegionError as err:
            raise CompressionConfigError(f"cannot broadcast this update: {err}") from None
        return grid, box

    @staticmethod
    def _residual(grid: ChunkGrid, residual: Tensor | None, device: torch.device) -> Tensor:
        """A copy of ``residual`` to write a box of a new one into (zeros for None)."""
        if residual is None:
            return torch.zeros(grid.padded(full_region(grid.shape)), device=device)
        return residual.clone()

    def _step(self, pending: Tensor, grid: ChunkGrid, box: Region,
              covered: tuple[Region, ...]) -> CoefficientStep:
        """The step keeping the ``topk`` largest of each chunk's ``pending`` coefficients
        (chunkwise over the box's chunks) as int8 levels in ``±level_max`` and a scale."""
        positions, kept = _largest(pending, grid, box, min(self.topk, grid.chunk_numel))
        positions, order = positions.sort(dim=1)  # in order inside each chunk: the decode's
        kept = kept.gather(1, order)
        most = self.level_max
        scales = kept.abs().amax(dim=1) / most  # float32, 0 for an all-zero chunk
        levels = torch.where(scales[:, None] > 0, kept / scales[:, None].clamp_min(1e-38), 0.0)
        return CoefficientStep(
            shape=grid.shape, covered=covered, box=box, chunk=grid.chunk,
            positions=positions, scales=scales,
            levels=levels.round().clamp(-most, most).to(torch.int8))


# Top-k per chunk in two passes: the largest magnitude of each run of this many elements
# along a chunk's last dimension, then the k largest elements of the k runs with the largest
# peaks (every element of the top k lies in one of them).
RUN = 8


def _largest(image: Tensor, grid: ChunkGrid, box: Region, k: int) -> tuple[Tensor, Tensor]:
    """(positions, values), each (n, k) in ``chunk_ids(box)`` order: the ``k`` entries of
    largest magnitude of each chunk of ``image`` (the box's chunks laid out chunkwise)."""
    counts, chunk = grid.region_counts(box), grid.chunk
    n, numel = math.prod(counts), grid.chunk_numel
    pairs = [m for pair in zip(counts, chunk, strict=True) for m in pair]
    order = [*range(0, 2 * len(chunk), 2), *range(1, 2 * len(chunk), 2)]  # chunk by chunk
    if chunk[-1] % RUN or numel // RUN < k:
        flat = image.view(pairs).permute(order).reshape(n, numel)  # (n, chunk_numel)
        positions = flat.abs().topk(k, dim=1).indices
        return positions, flat.gather(1, positions)
    low, high = torch.aminmax(image.view(-1, RUN), dim=1)
    peaks = torch.maximum(high, low.neg_())  # one per run, laid out as the runs lie
    peaks = peaks.view(*pairs[:-1], chunk[-1] // RUN).permute(order).reshape(n, numel // RUN)
    first = peaks.topk(k, dim=1).indices * RUN  # (n, k): where each chosen run starts
    ids = grid.chunk_ids(box).to(image.device).unsqueeze(1)
    runs = grid.flat_index(box, ids, first) // RUN  # each a row of image.view(-1, RUN)
    values = image.view(-1, RUN).index_select(0, runs.reshape(-1)).view(n, k * RUN)
    pick = values.abs().topk(k, dim=1).indices
    positions = (first.unsqueeze(-1) + torch.arange(RUN, device=image.device)).view(n, -1)
    return positions.gather(1, pick), values.gather(1, pick)


def _hull(grid: ChunkGrid, box: Region) -> tuple[slice, ...]:
    """Where the chunks ``box`` touches lie in a tensor of shape ``grid.padded(whole)``."""
    return tuple(slice(start, start + n) for (start, _), n in
                 zip(box, grid.padded(box), strict=True))
