"""Aggregation over clients at different tiers, validation of results, update rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.models import tiny_config

from matformer.modeling import AutoregressiveModel
from matformer.modeling.compression import (
    CompressionConfig,
    SparseResult,
    UpdateConfig,
    decode,
    full_region,
    region_slices,
    tier_regions,
    universal_shapes,
)
from matformer.modeling.errors import (
    BadTokenCount,
    ChunkIdError,
    ChunkIndexError,
    CompressionConfigError,
    CompressionError,
    NonFiniteValues,
    RegionError,
    ResultShapeMismatch,
    UnknownEncoding,
)
from matformer.server import aggregation
from matformer.server.aggregation import aggregate, scatter
from matformer.server.update_steps import update_step

DOWN = (2, 4)  # a down_proj: FFN width 4 in columns; tier 1 covers columns [:2]


def _dense(values: list[list[float]], region, tokens: int, shape=DOWN) -> SparseResult:
    compressor = CompressionConfig(encoding="dense").build()
    return compressor.encode(
        "down", torch.tensor(values, dtype=torch.float32), shape=shape, region=region,
        tokens=tokens,
    )


def test_aggregate_is_token_weighted_and_coverage_normalised():
    tier0 = _dense([[1, 2, 3, 4], [5, 6, 7, 8]], ((0, 2), (0, 4)), tokens=3)
    tier1 = _dense([[5, 6], [9, 10]], ((0, 2), (0, 2)), tokens=1)
    update = aggregate([tier0, tier1])
    # shared columns: (3·a + 1·b) / 4; tail columns: tier 0's values, it alone covers them
    assert update.values.tolist() == [[2, 3, 3, 4], [6, 7, 7, 8]]
    assert update.tokens.tolist() == [[4, 4, 3, 3], [4, 4, 3, 3]]
    assert update.covered.all()


def test_majority_votes_count_each_result_once_whatever_its_tokens_or_magnitude():
    loud = _dense([[1e6, 1e6, 1e6, 1e6], [1e6, -1e6, 1e6, 1e6]], ((0, 2), (0, 4)), tokens=10**6)
    quiet_a = _dense([[-0.1, -0.1], [-0.1, 0.1]], ((0, 2), (0, 2)), tokens=1)
    quiet_b = _dense([[-0.2, 0.3], [0.0, 0.2]], ((0, 2), (0, 2)), tokens=1)
    update = aggregate([loud, quiet_a, quiet_b], votes=True)
    # shared columns: the mean of three signs (a zero abstains); tail columns: the loud
    # result alone votes
    third = 1 / 3
    expected = torch.tensor([[-third, third, 1, 1], [0, third, 1, 1]])
    assert torch.allclose(update.values, expected)
    assert torch.sign(update.values[0, 0]) == -1  # two quiet votes beat a million tokens
    assert update.tokens.tolist() == aggregate([loud, quiet_a, quiet_b]).tokens.tolist()
    tie = aggregate([_dense([[1.0, 1.0]] * 2, ((0, 2), (0, 2)), 5, shape=(2, 2)),
                     _dense([[-1.0, 1.0]] * 2, ((0, 2), (0, 2)), 1, shape=(2, 2))], votes=True)
    assert tie.values.tolist() == [[0, 1], [0, 1]]  # a tie moves nothing under the sign rule


def test_dense_aggregation_decodes_each_result_once(monkeypatch):
    calls = []
    monkeypatch.setattr(aggregation, "decode", lambda r: calls.append(r) or decode(r))
    results = [_dense([[1.0, 2.0]], ((0, 1), (0, 2)), tokens=t, shape=(1, 4)) for t in range(1, 9)]
    aggregate(results)
    assert calls == results  # one pass per client: linear in the number of clients


def _decoded_reference(results) -> torch.Tensor:
    """Decode every result, then the token-weighted, coverage-normalised mean, in float64."""
    shape = results[0].shape
    tokens = torch.zeros(shape, dtype=torch.float64)
    for r in results:
        tokens[region_slices(r.region)] += r.tokens
    values = torch.zeros(shape, dtype=torch.float64)
    for r in results:
        where = region_slices(r.region)
        values[where] += decode(r).double() * r.tokens / tokens[where]
    return values


@pytest.mark.parametrize("encoding", ["dct", "topk"])
@pytest.mark.parametrize(("widths", "decoded"), [
    ((256, 128, 64), 0),  # tier widths on the 32-grid: every chunk summed as coefficients
    ((256, 128, 80), 9),  # width 80 cuts a chunk that all 9 results touch: all decoded there
])
def test_coefficient_domain_aggregation_equals_decode_then_aggregate(monkeypatch, encoding,
                                                                     widths, decoded):
    """Tiers 0, 1, 2 of a (96, 256) down_proj (the FFN width in columns; 96 rows make a
    partial edge chunk of the universal grid) with several clients per tier, DeMo-style
    top-k per 32 x 32 chunk in bfloat16."""
    compressor = CompressionConfig(encoding=encoding, chunk=32, topk=24,
                                   value_dtype="bfloat16").build()
    gen = torch.Generator().manual_seed(0)
    results = []
    for i, width in enumerate(w for w in widths for _ in range(3)):
        values = torch.randn(96, width, generator=gen)
        results.append(compressor.encode("down", values, shape=(96, 256),
                                         region=((0, 96), (0, width)), tokens=100 + 37 * i))
    calls = []
    monkeypatch.setattr(aggregation, "decode", lambda r: calls.append(r) or decode(r))
    update = aggregate(results)
    assert len(calls) == decoded  # only results touching a chunk that one of them cuts
    reference = _decoded_reference(results)
    assert torch.allclose(update.values.double(), reference, rtol=1e-5, atol=1e-5)
    assert update.values.abs().max() > 0.1  # not trivially zero


@pytest.mark.parametrize("widths", [(256, 128, 64), (256, 128, 80)])
def test_results_summed_in_batches_give_the_bits_of_one_at_a_time(monkeypatch, widths):
    """``_weighted_sum`` adds a batch of results with one ``index_add_``; the master a
    resume replays must be the same bits whatever the batch, down to one result each."""
    compressor = CompressionConfig(encoding="dct", chunk=32, topk=24,
                                   value_dtype="bfloat16").build()
    gen = torch.Generator().manual_seed(1)
    results = [compressor.encode("down", torch.randn(96, width, generator=gen),
                                 shape=(96, 256), region=((0, 96), (0, width)),
                                 tokens=100 + 37 * i)
               for i, width in enumerate(w for w in widths for _ in range(5))]
    together = aggregate(results).values
    monkeypatch.setattr(aggregation, "SUM_BATCH", 1)  # one result per index_add_
    assert torch.equal(aggregate(results).values, together)
    monkeypatch.setattr(aggregation, "SUM_BATCH", 3 * 24 * 9)  # a few results per batch
    assert torch.equal(aggregate(results).values, together)
    # results of another k (a relay's partial, a member of other settings) start a batch
    fewer = CompressionConfig(encoding="dct", chunk=32, topk=12, value_dtype="bfloat16").build()
    mixed_k = [*results[:4], fewer.encode("down", torch.randn(96, 256, generator=gen),
                                          shape=(96, 256), region=((0, 96), (0, 256)),
                                          tokens=77), *results[4:]]
    monkeypatch.setattr(aggregation, "SUM_BATCH", 1)
    one_at_a_time = aggregate(mixed_k).values
    monkeypatch.setattr(aggregation, "SUM_BATCH", 2**18)
    assert torch.equal(aggregate(mixed_k).values, one_at_a_time)


def test_elements_nobody_covered_stay_zero_and_uncovered():
    tier1 = _dense([[1, 2], [3, 4]], ((0, 2), (0, 2)), tokens=1)
    tier2 = _dense([[5], [7]], ((0, 2), (0, 1)), tokens=3)
    update = aggregate([tier1, tier2])
    assert update.values.tolist() == [[4, 2, 0, 0], [6, 4, 0, 0]]
    assert update.covered.tolist() == [[True, True, False, False]] * 2


def test_one_client_comes_through_unchanged_whatever_its_tokens():
    values = torch.randn(64, 48) * 1e-3
    for tokens in (1, 3, 7, 41, 12345):
        result = CompressionConfig(encoding="dense").build().encode(
            "w", values, shape=(100, 48), region=((0, 64), (0, 48)), tokens=tokens
        )
        update = scatter(result)
        assert torch.equal(update.values[:64], values)
        assert not update.values[64:].any() and not update.covered[64:].any()


def test_compressed_results_aggregate_like_their_decoded_values():
    shape = (128, 96)
    compressor = CompressionConfig(chunk=32, topk=16).build()
    regions = [full_region(shape), ((0, 64), (0, 96)), ((0, 48), (0, 96))]  # ends mid-chunk
    results = [
        compressor.encode("w", torch.randn(r[0][1], 96), shape=shape, region=r, tokens=t)
        for r, t in zip(regions, (5, 2, 1), strict=True)
    ]
    update = aggregate(results)
    total = torch.zeros(shape)
    tokens = torch.zeros(shape)
    for result in results:
        total[region_slices(result.region)] += result.tokens * decode(result)
        tokens[region_slices(result.region)] += result.tokens
    torch.testing.assert_close(update.values, total / tokens)


def _good() -> SparseResult:
    compressor = CompressionConfig(chunk=4, topk=3, value_dtype="float32").build()
    return compressor.encode("w", torch.randn(8, 6), shape=(8, 8), region=((0, 8), (0, 6)),
                             tokens=2)  # 2 x 2 chunks: ids 0, 1, 2, 3


def _with(**fields) -> SparseResult:
    return dataclasses.replace(_good(), **fields)


def _values_with(value: float) -> torch.Tensor:
    values = _good().values.clone()
    values[1, 2] = value
    return values


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: _with(encoding="zstd"), UnknownEncoding, "unknown encoding 'zstd'"),
        (lambda: _with(region=((0, 8), (0, 9))), RegionError, "outside shape"),
        (lambda: _with(region=((2, 8), (0, 6))), RegionError, "off the chunk grid"),
        (lambda: _with(chunks=torch.tensor([0, 1, 2, 4])), ChunkIdError, r"in \[0, 4\)"),
        (lambda: _with(chunks=torch.tensor([0, 1, 1, 3])), ChunkIdError, "repeated"),
        (lambda: _with(region=((0, 4), (0, 6))), ChunkIdError, "outside region"),
        (lambda: _with(indices=_good().indices + 16), ChunkIndexError, r"in \[0, 16\)"),
        (lambda: _with(indices=_good().indices[:, [0, 0, 1]]), ChunkIndexError, "repeated"),
        (lambda: _with(values=_values_with(float("nan"))), NonFiniteValues, "NaN"),
        (lambda: _with(values=_values_with(float("inf"))), NonFiniteValues, "infinity"),
        (lambda: _with(values=_good().values[:, :2]), ResultShapeMismatch, "values of shape"),
        (lambda: _with(indices=_good().indices[:3]), ResultShapeMismatch, "one row per chunk"),
        (lambda: _with(chunk=(4,)), ResultShapeMismatch, "does not fit shape"),
        (lambda: _with(indices=_good().indices.float()), ResultShapeMismatch, "integer"),
        (lambda: _with(tokens=0), BadTokenCount, "positive integer"),
        (lambda: _with(encoding="dense"), ResultShapeMismatch, "a dense result has chunk"),
        (lambda: dataclasses.replace(_dense([[1, 2, 3, 4]], ((0, 1), (0, 4)), 1, shape=(8, 8)),
                                     values=torch.ones(2, 4)), ResultShapeMismatch,
         "values of shape"),
    ],
)
def test_malformed_results_raise_before_anything_is_aggregated(make, error, message):
    good = _good()
    before = good.values.clone()
    with pytest.raises(error, match=message):
        aggregate([good, make()])
    assert torch.equal(good.values, before)
    assert issubclass(error, CompressionError)


def test_results_for_different_parameters_do_not_aggregate():
    with pytest.raises(ResultShapeMismatch, match="aggregate each parameter on its own"):
        aggregate([_good(), _with(name="v")])
    with pytest.raises(CompressionError, match="at least one result"):
        aggregate([])


def test_sgd_and_sign_move_covered_elements_only():
    weight = torch.tensor([1.0, 2.0, 3.0, 4.0])
    update = _dense([[0.5, -2.0]], ((0, 1), (0, 2)), tokens=1, shape=(1, 4))
    agg = aggregate([update])
    sgd = UpdateConfig(rule="sgd", lr=0.5).build()
    step, _ = update_step(sgd, agg, [update.region])
    assert sgd.apply(weight.reshape(1, 4), step).tolist() == [[0.75, 3.0, 3.0, 4.0]]
    sign = UpdateConfig(rule="sign", lr=0.5, weight_decay=0.1).build()
    step, _ = update_step(sign, agg, [update.region])
    assert step.values.dtype == torch.int8  # the sign rule reads signs only: 1 byte each
    # w·(1 − 0.05) − 0.5·sign(agg) on the covered two; the tail keeps its value (no decay)
    expected = [[1.0 * 0.95 - 0.5, 2.0 * 0.95 + 0.5, 3.0, 4.0]]
    torch.testing.assert_close(sign.apply(weight.reshape(1, 4), step), torch.tensor(expected))


@pytest.mark.parametrize("rule", ["sgd", "sign"])
def test_a_client_updating_its_slice_stays_equal_to_the_master(rule):
    config = tiny_config(intermediate_size=64)
    shapes = universal_shapes(config)
    compressor = CompressionConfig(chunk=16, topk=20).build()
    apply = UpdateConfig(rule=rule, lr=1e-2, weight_decay=0.1).build()
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        results = [
            compressor.encode(name, torch.randn(r[0][1] - r[0][0], r[1][1] - r[1][0]),
                              shape=shapes[name], region=r, tokens=t)
            for r, t in ((tier_regions(shapes, config, tier)[name], 10 + tier)
                         for tier in (1, 2))
        ]
        step, _ = update_step(apply, aggregate(results), [r.region for r in results])
        master = torch.randn(shapes[name])
        region = tier_regions(shapes, config, 1)[name]
        client = master[region_slices(region)].clone()
        after = apply.apply(master, step)
        assert torch.equal(apply.apply(client, step.cut(region), region),
                           after[region_slices(region)])
        tail = ~step.mask(full_region(shapes[name]))
        assert tail.any() and torch.equal(after[tail], master[tail])


@pytest.mark.parametrize("tier", [0, 1])
def test_federated_without_compression_equals_standalone_sgd(tier):
    config = tiny_config(intermediate_size=64)
    torch.manual_seed(1)
    standalone = AutoregressiveModel(config)
    federated = AutoregressiveModel(config)
    federated.load_state_dict(standalone.state_dict())
    ids = torch.randint(0, 90, (2, 12))
    optimizer = torch.optim.SGD(standalone.parameters(), lr=0.1)
    standalone.loss(ids, tier=tier).backward()
    optimizer.step()

    federated.loss(ids, tier=tier).backward()
    compressor = CompressionConfig(encoding="dense", decay=0.0, lr=1.0).build()
    sgd = UpdateConfig(rule="sgd", lr=0.1).build()
    regions = tier_regions(universal_shapes(config), config, tier)
    with torch.no_grad():
        for name, param in federated.named_parameters():
            where = region_slices(regions[name])
            state = compressor.feedback(name, tuple(param.shape), regions[name])
            result = state.step(param.grad[where], tokens=24)
            step, _ = update_step(sgd, aggregate([result]), [result.region])
            param.copy_(sgd.apply(param, step))
    for name, param in standalone.named_parameters():
        assert torch.equal(param, federated.get_parameter(name)), name


def test_bad_update_settings_are_named_errors():
    with pytest.raises(CompressionConfigError, match="unknown update rule 'adam'"):
        UpdateConfig(rule="adam", lr=1.0)
    with pytest.raises(CompressionConfigError, match="lr must be > 0"):
        UpdateConfig(lr=0.0)


def test_weight_hash_of_a_tier_slice_equals_the_masters_hash_at_that_tier():
    from support.models import tiny_config

    from matformer.modeling import AutoregressiveModel, layer_widths
    from matformer.modeling.checkpoint.slicing import slice_state
    from matformer.modeling.compression import tier_regions, universal_shapes, weight_hash

    config = tiny_config()
    master = AutoregressiveModel(config).state_dict()
    regions = tier_regions(universal_shapes(config), config, 1)
    widths = layer_widths(config, 1)
    replica = {name: t.clone() for name, t in slice_state(master, widths).items()}
    assert weight_hash(replica) == weight_hash(master, regions)
    assert weight_hash(replica) != weight_hash(master)
    replica["model.layers.0.mlp.up_proj.weight"][0, 0] += 1e-6
    assert weight_hash(replica) != weight_hash(master, regions)
