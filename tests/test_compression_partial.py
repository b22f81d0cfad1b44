"""Partial sums (modeling/compression/partial.py): the root aggregating a relay's partials
gets what it gets from the members' own results, within float32 rounding."""

from __future__ import annotations

import pytest
import torch

from matformer.modeling.compression import CompressionConfig, decode
from matformer.modeling.compression.partial import partial_sums
from matformer.modeling.errors import CompressionError
from matformer.server.aggregation import aggregate, coefficient_mean

SHAPE = (96, 256)  # a down_proj: FFN width in columns; 96 rows leave a partial edge chunk


def _results(encoding: str, widths: tuple[int, ...], *, seed: int = 0, topk: int = 24):
    """Three members per width, each with its own tokens, top-k per 32 x 32 chunk."""
    compressor = CompressionConfig(encoding=encoding, chunk=32, topk=topk,
                                   value_dtype="bfloat16").build()
    gen = torch.Generator().manual_seed(seed)
    return [compressor.encode("down", torch.randn(96, width, generator=gen), shape=SHAPE,
                              region=((0, 96), (0, width)), tokens=100 + 37 * i)
            for i, width in enumerate(w for w in widths for _ in range(3))]


@pytest.mark.parametrize("encoding", ["dct", "topk", "dense"])
@pytest.mark.parametrize("widths", [(256, 128, 64), (256, 128, 80)])  # 80: off the chunk grid
def test_the_root_aggregates_partials_as_it_aggregates_the_members_results(encoding, widths):
    results = _results(encoding, widths)
    # two relays, each with some members of every tier, and one member joined directly
    partials = partial_sums(results[0:-1:2]) + partial_sums(results[1:-1:2]) + results[-1:]
    direct, relayed = aggregate(results), aggregate(partials)
    assert torch.equal(relayed.tokens, direct.tokens)  # the same coverage, exactly
    scale = direct.values.abs().max()
    assert scale > 0.1  # not trivially zero
    # float32 rounding of a different order of sums: a few ulps of the largest value
    assert (relayed.values - direct.values).abs().max() <= 1e-6 * scale


def test_a_partial_holds_one_result_per_region_with_the_tokens_of_its_members():
    results = _results("dct", (256, 128, 64))
    partials = partial_sums(results)
    assert [(p.region, p.tokens) for p in partials] == [
        (results[i].region, sum(r.tokens for r in results[i:i + 3])) for i in (0, 3, 6)]
    assert all(p.values.dtype == torch.float32 for p in partials)


def test_a_partial_is_never_larger_than_its_regions_dense_coefficients():
    """Members whose positions cover every chunk whole: the partial is the dense chunk."""
    results = _results("dct", (256,) * 12, topk=512)  # 36 members x 512 of 1,024 positions
    (partial,) = partial_sums(results)
    assert partial.indices.shape == (len(results[0].chunks), 32 * 32)
    assert torch.equal(partial.indices[0], torch.arange(32 * 32))


def test_positions_no_member_sent_are_not_sent_and_a_lone_member_comes_through_exactly():
    (lone,) = _results("dct", (128,))[:1]
    (partial,) = partial_sums([lone])
    assert partial.indices.shape == lone.indices.shape
    assert torch.equal(decode(partial), decode(lone))  # share 1.0, bfloat16 → float32 exact
    assert torch.equal(coefficient_mean([partial]), coefficient_mean([lone]))


def test_results_of_two_encodings_are_refused():
    dct = _results("dct", (256,))[0]
    topk = _results("topk", (256,))[0]
    with pytest.raises(CompressionError, match="several encodings"):
        partial_sums([dct, topk])


def _dense_coefficients(result, ids) -> torch.Tensor:
    """(chunks of the region, chunk_numel): a chunked result's coefficients, zeros elsewhere."""
    out = torch.zeros(len(ids), 32 * 32)
    rows = torch.searchsorted(ids, result.chunks.long()).unsqueeze(1)
    out[rows, result.indices.long()] = result.values.float()
    return out


def test_a_recompressed_partial_sends_k_per_chunk_and_carries_the_rest_to_the_next_round():
    from matformer.modeling.compression.grid import ChunkGrid
    from matformer.modeling.compression.partial import Recompressor

    cut = Recompressor(topk=8)
    first, second = (partial_sums(_results("dct", (256,), seed=s))[0] for s in (1, 2))
    ids = ChunkGrid(shape=SHAPE, chunk=(32, 32)).chunk_ids(first.region)
    sent = cut(first)
    assert sent.indices.shape == (len(ids), 8) and sent.tokens == first.tokens
    carried = cut.carried[first.name, first.region].clone()
    # nothing is lost: what went plus what stayed is the members' exact sum
    assert torch.equal(_dense_coefficients(sent, ids) + carried, _dense_coefficients(first, ids))
    # the largest go first: nothing carried is larger than what its chunk sent
    assert bool((carried.abs().max(dim=1).values <= sent.values.abs().min(dim=1).values).all())
    again = cut(second)  # next round: the carried coefficients ride along
    assert torch.allclose(_dense_coefficients(again, ids) + cut.carried[first.name, first.region],
                          carried + _dense_coefficients(second, ids))
    dense = _results("dense", (128,))[0]
    assert cut(dense) is dense
