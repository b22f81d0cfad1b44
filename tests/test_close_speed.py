"""The fast close (issue 31): each shortcut equals the plain computation it replaces. The
sparse exact decode has the dense exact decode's bits; the two-pass top-k keeps plain
top-k's coefficients; transforms on chunks where they lie equal transforms of stacked
chunks; a close summed in the coefficient domain sends what the value-domain close sends
and carries what it leaves out, to the exact decode's rounding (``decode_bound``), with the
outer momentum kept there too; replicas applying its steps hold the master's bits."""

from __future__ import annotations

import math

import pytest
import torch

from matformer.modeling.compression import (
    Broadcast,
    ChunkGrid,
    CoefficientStep,
    CompressionConfig,
    RoundUpdate,
    UpdateConfig,
    dct,
    full_region,
    region_slices,
    steps,
)
from matformer.modeling.compression.dct import chunkwise_dct, exact_bits, exact_idct
from matformer.modeling.compression.steps import _largest
from matformer.protocol.updates import read_updates, update_messages
from matformer.server import update_steps
from matformer.server.aggregation import aggregate, coefficient_mean
from matformer.server.update_steps import Carried, close_round

UP = "model.layers.0.mlp.up_proj.weight"
SHAPE = (256, 128)  # FFN rows × hidden: every tier's width lies on the 64-grid
TIERS = {0: ((0, 256), (0, 128)), 1: ((0, 128), (0, 128)), 2: ((0, 64), (0, 128))}
NORM, NORM_SHAPE = "model.norm.weight", (128,)
BROADCAST = Broadcast(topk=48, chunk=64)


def _results(seed: int, tiers: dict = TIERS) -> dict:
    """DCT results (chunk 64, top 32, bfloat16) of UP at each tier and of the norm."""
    gen = torch.Generator().manual_seed(seed)
    compressor = CompressionConfig(encoding="dct", chunk=64, topk=32).build()
    ups = [compressor.encode(UP, torch.randn(r[0][1], r[1][1], generator=gen), shape=SHAPE,
                             region=r, tokens=100 * (tier + 1)) for tier, r in tiers.items()]
    norm = compressor.encode(NORM, torch.randn(NORM_SHAPE, generator=gen), shape=NORM_SHAPE,
                             region=((0, 128),), tokens=600)
    return {UP: ups, NORM: [norm]}


def _random_step(shape, chunk_size, k, box, seed=0) -> CoefficientStep:
    """A step of random levels, positions in no particular order inside each chunk."""
    gen = torch.Generator().manual_seed(seed)
    grid = ChunkGrid.of(shape, chunk_size)
    n = len(grid.chunk_ids(box))
    positions = torch.rand(n, grid.chunk_numel, generator=gen).argsort(dim=1)[:, :k]
    return CoefficientStep(
        shape=tuple(shape), covered=(box,), box=box, chunk=grid.chunk, positions=positions,
        levels=torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8),
        scales=torch.rand(n, generator=gen) * 1e-2)


def _dense_decode(step: CoefficientStep, region) -> torch.Tensor:
    """The decode as it was first written: dense levels, ``exact_idct``, assembled."""
    grid = step.grid
    levels = torch.zeros(len(step.levels), grid.chunk_numel, dtype=torch.float64)
    levels.scatter_(1, step.positions, step.levels.double())
    bits = exact_bits(step.chunk)
    scaled = exact_idct(levels.reshape(-1, *step.chunk), bits)
    factor = step.scales.double() / 2.0 ** (bits * len(step.chunk))
    values = (scaled * factor.reshape(-1, *[1] * len(step.chunk))).float()
    out = torch.zeros(step.shape)
    out[region_slices(step.box)] = grid.assemble(values, step.box)
    return out[region_slices(region)]


@pytest.mark.parametrize(("shape", "chunk", "k", "box"), [
    ((256, 128), 64, 48, ((0, 256), (0, 128))),
    ((192, 130), 64, 48, ((0, 192), (0, 130))),  # partial edge chunks along both dimensions
    ((192, 130), 64, 40, ((64, 150), (0, 130))),  # a box off the origin, ending mid-chunk
    ((130,), 64, 20, ((0, 130),)),  # a norm: one dimension
    ((8, 6, 10), 4, 5, ((0, 8), (0, 6), (0, 10))),  # three dimensions
])
@pytest.mark.parametrize("block", [steps.BLOCK_BYTES, 1])  # 1: a row of chunks at a time
def test_the_sparse_decode_has_the_dense_decodes_bits(monkeypatch, shape, chunk, k, box, block):
    monkeypatch.setattr(steps, "BLOCK_BYTES", block)
    step = _random_step(shape, chunk, k, box)
    for region in (box, full_region(shape), tuple((0, (b + e) // 2) for b, e in box)):
        assert torch.equal(step.direction(region), _dense_decode(step, region)), region
        cut = step.cut(region)
        if cut is not None:  # what a tier downloads decodes to the same bits
            assert torch.equal(cut.direction(region), _dense_decode(step, region))


def test_the_decode_is_bit_identical_across_thread_counts():
    step = _random_step((256, 128), 64, 48, ((0, 256), (0, 128)))
    threads = torch.get_num_threads()
    try:
        directions = []
        for n in (1, 2):
            torch.set_num_threads(n)
            directions.append(step.direction(step.box))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(directions[0], directions[1])


@pytest.mark.parametrize(("shape", "chunk", "k"), [
    ((256, 192), 64, 48), ((192, 130), 64, 48), ((128,), 64, 20), ((96, 40), 32, 24),
    ((64, 64), 64, 300),  # more than a chunk's runs: plain top-k
])
def test_two_pass_top_k_keeps_the_plain_top_k(shape, chunk, k):
    grid = ChunkGrid.of(shape, chunk)
    box = full_region(shape)
    image = torch.randn(grid.padded(box), generator=torch.Generator().manual_seed(0))
    positions, values = _largest(image, grid, box, k)
    counts = grid.region_counts(box)
    pairs = [n for pair in zip(counts, grid.chunk, strict=True) for n in pair]
    blocks = image.view(pairs).permute(
        *range(0, 2 * len(counts), 2), *range(1, 2 * len(counts), 2)).reshape(
        math.prod(counts), -1)
    plain = blocks.abs().topk(k, dim=1).indices
    assert torch.equal(positions.sort(dim=1).values, plain.sort(dim=1).values)
    assert torch.equal(values, blocks.gather(1, positions))


def test_transforms_of_chunks_where_they_lie_equal_transforms_of_stacked_chunks():
    grid = ChunkGrid.of((192, 130), 64)
    values = torch.randn(192, 130, generator=torch.Generator().manual_seed(0))
    padded = torch.zeros(grid.padded(full_region(grid.shape)))
    padded[:192, :130] = values
    stacked = dct(grid.blocks(values, full_region(grid.shape)))
    in_place = grid.blocks(chunkwise_dct(padded, grid.chunk), full_region(padded.shape))
    torch.testing.assert_close(in_place, stacked, atol=1e-5, rtol=0)


@pytest.mark.parametrize("tiers", [TIERS, {1: TIERS[1], 2: TIERS[2]}])  # no tier 0: a box
@pytest.mark.parametrize("block", [steps.BLOCK_BYTES, 1])
def test_a_close_in_coefficients_sends_what_a_close_in_values_sends(monkeypatch, tiers, block):
    monkeypatch.setattr(steps, "BLOCK_BYTES", block)
    results = _results(0, tiers)[UP]
    covered = [r.region for r in results]
    earlier = BROADCAST.residual_of(torch.randn(SHAPE, generator=torch.Generator().manual_seed(9)))
    by_values, left_values, _ = BROADCAST.encode(aggregate(results).values, covered, earlier)
    by_coefficients, left_coefficients = BROADCAST.encode_coefficients(
        coefficient_mean(results), SHAPE, covered, earlier)
    same = (by_values.positions == by_coefficients.positions).float().mean()
    assert same > 0.99  # round-off may swap a near tie, nothing more
    # what was sent plus what is left is the same either way, but for what the coefficient
    # close does not feed back: the exact decode's rounding of the basis
    full = full_region(SHAPE)
    torch.testing.assert_close(
        by_coefficients.direction(full) + BROADCAST.values_of(left_coefficients, SHAPE),
        by_values.direction(full) + BROADCAST.values_of(left_values, SHAPE),
        atol=1e-5 + decode_bound(by_coefficients), rtol=0)


def test_the_fast_close_keeps_replicas_exact_and_carries_what_it_left_out(monkeypatch):
    def no_value_path(*args, **kwargs):
        raise AssertionError("on-grid DCT results should close in the coefficient domain")

    monkeypatch.setattr(update_steps, "aggregate", no_value_path)
    config = UpdateConfig(rule="sgd", lr=1.0, broadcast_topk=48, chunk=64)
    master = {UP: torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)),
              NORM: torch.randn(NORM_SHAPE, generator=torch.Generator().manual_seed(2))}
    replicas = {tier: {UP: master[UP][region_slices(r)].clone(), NORM: master[NORM].clone()}
                for tier, r in TIERS.items()}
    carried, start, total = Carried(), master[UP].clone(), torch.zeros(SHAPE)
    bound = 0.0
    for seed in range(3):
        results = _results(seed)
        total += _decoded_mean(results[UP])
        after, steps, carried = close_round(config.build(), master, results, carried)
        bound += decode_bound(steps[UP])
        update = RoundUpdate(round=seed, update=config, steps=steps, hashes={})
        assert all(torch.equal(after[n], t) for n, t in update.apply(master).items())
        for tier, region in TIERS.items():
            regions = {UP: region, NORM: ((0, 128),)}
            (download,) = read_updates(update_messages([update.cut(tier, regions)]), tier=tier)
            replicas[tier] = download.apply(replicas[tier], regions)
            for name in master:
                assert torch.equal(replicas[tier][name],
                                   after[name][region_slices(regions[name])]), (tier, name)
        master = after
    # sgd with lr 1: the master moved by everything sent; sent plus left is every aggregate
    left = BROADCAST.values_of(carried.residual[UP], SHAPE)
    torch.testing.assert_close(start - master[UP] + left, total, atol=1e-5 + bound, rtol=0)


def test_the_residual_carries_over_when_a_parameter_changes_path():
    """Rounds whose regions lie on the grid close in coefficients, one with a tier width
    inside a chunk closes in values; the residual means the same to both."""
    config = UpdateConfig(rule="sgd", lr=1.0, broadcast_topk=48, chunk=64)
    off_grid = {0: TIERS[0], 1: ((0, 96), (0, 128))}
    master = {UP: torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))}
    carried, start, total = Carried(), master[UP].clone(), torch.zeros(SHAPE)
    bound = 0.0
    for seed, tiers in enumerate([TIERS, off_grid, TIERS, off_grid]):
        results = {UP: _results(seed, tiers)[UP]}
        total += _decoded_mean(results[UP])
        master, steps, carried = close_round(config.build(), master, results, carried)
        bound += decode_bound(steps[UP]) if tiers is TIERS else 0.0  # values: fed back
    left = BROADCAST.values_of(carried.residual[UP], SHAPE)
    torch.testing.assert_close(start - master[UP] + left, total, atol=2e-5 + bound, rtol=0)


def test_the_outer_momentum_in_coefficients_is_the_momentum_in_values():
    """DiLoCo's outer Nesterov momentum kept in the broadcast's coefficients: its buffer,
    taken back to values, is the buffer a close in values keeps, and the master less what
    is left to send moves as that close's does, to the decode's rounding."""
    rule = UpdateConfig(rule="sgd", lr=0.7, broadcast_topk=48, chunk=64).build()
    momentum = update_steps.Momentum(0.9, nesterov=True)
    start = torch.randn(SHAPE, generator=torch.Generator().manual_seed(1))
    ours, carried = {UP: start.clone()}, Carried()
    theirs, buffer, residual = start.clone(), None, None
    bound = 0.0
    for seed, tiers in enumerate([TIERS, {1: TIERS[1], 2: TIERS[2]}, TIERS]):  # then a box
        results = _results(seed, tiers)[UP]
        ours, steps, carried = close_round(rule, ours, {UP: results}, carried,
                                           momentum=momentum)
        bound += rule.lr * decode_bound(steps[UP])
        mean = aggregate(results)
        values, buffer = momentum.direction(mean.values, mean.covered, buffer)
        step, residual, decoded = BROADCAST.encode(values, [r.region for r in results],
                                                   residual)
        theirs = rule.apply(theirs, step, direction=decoded)
    torch.testing.assert_close(BROADCAST.values_of(carried.momentum[UP], SHAPE), buffer,
                               atol=1e-5, rtol=0)
    # the master less lr times what is left to send is the same either way (the steps may
    # differ: a near tie, or a chunk with fewer than k nonzero coefficients, where the
    # values' round-off picks other zeros)
    torch.testing.assert_close(
        ours[UP] - rule.lr * BROADCAST.values_of(carried.residual[UP], SHAPE),
        theirs - rule.lr * BROADCAST.values_of(residual, SHAPE), atol=2e-5 + bound, rtol=0)


def _decoded_mean(results) -> torch.Tensor:
    """The token-weighted mean of the results' decoded values, by the value-domain path."""
    return aggregate(results).values


def decode_bound(step: CoefficientStep) -> float:
    """How far the exact decode of ``step`` may lie from the kept coefficients' true inverse
    DCT, per element: each integer basis entry is the DCT's to 2^-(bits+1), so a
    coefficient's decode is off by under 2^-bits of it (under 2·2^-(bits+1) for a product of
    two entries each at most 1), summed over a chunk's kept coefficients."""
    kept = step.levels.abs().float().sum(dim=1) * step.scales
    return float(kept.max()) * 2.0 ** -exact_bits(step.chunk)


def test_off_grid_results_and_votes_close_in_values(monkeypatch):
    def no_coefficients(*args, **kwargs):
        raise AssertionError("these closes need the values")

    monkeypatch.setattr(update_steps, "coefficient_mean", no_coefficients)
    rule = UpdateConfig(rule="sign", lr=0.01, broadcast_topk=48, chunk=64).build()
    off_grid = {1: ((0, 96), (0, 128))}  # a width that ends inside a chunk
    master = {UP: torch.zeros(SHAPE), NORM: torch.zeros(NORM_SHAPE)}
    close_round(rule, master, {UP: _results(0, off_grid)[UP]})
    close_round(rule, master, _results(0), votes=True)


@pytest.mark.parametrize("rule", ["sgd", "sign"])
def test_a_replica_moving_its_weights_in_place_holds_the_same_bits(rule):
    """``apply(..., out=weight)`` (a replica's parameter, moved where it lies) gives the bits
    of the apply that returns a new tensor: a compressed step over part of a tier's region
    and a dense one, a box the step covers in part, weight decay."""
    config = UpdateConfig(rule=rule, lr=0.01, weight_decay=0.1, broadcast_topk=48, chunk=64)
    results = _results(0)
    _, steps, _ = close_round(config.build(), {UP: torch.zeros(SHAPE), NORM: torch.zeros(
        NORM_SHAPE)}, results)
    region = TIERS[1]
    gen = torch.Generator().manual_seed(3)
    compressed = steps[UP]
    partial = CoefficientStep(  # covers only the first row of chunks of the box
        shape=compressed.shape, covered=(((0, 64), (0, 128)),), box=compressed.box,
        chunk=compressed.chunk, positions=compressed.positions, levels=compressed.levels,
        scales=compressed.scales)
    dense = update_steps.dense_step(torch.randn(SHAPE, generator=gen), [((0, 192), (0, 128))],
                                    signs=False)
    for step in (compressed, partial, dense):
        weight = torch.randn(128, 128, generator=gen)
        expected = config.build().apply(weight, step, region)
        moved = config.build().apply(weight, step, region, out=weight)
        assert moved is weight and torch.equal(weight, expected)
