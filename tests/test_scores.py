"""Contribution scores (server/scores.py; issue 47, item 3): each accepted result's agreement
with its peers', taken where the results were sent, tells a member that pushes against the
others at an honest norm, which no norm bound can see; the judge excludes it once its mean
over a window is below [faults] min_score."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import matformer.server.scores as scores_module
from matformer.modeling.compression import CompressionConfig, SparseResult
from matformer.modeling.compression.grid import region_slices
from matformer.server.membership import Member
from matformer.server.scores import MIN_RESULTS, PAIRWISE_MAX, ScoreJudge, agreement
from matformer.server.sections import FaultsSection

SHAPES = {"w": (12, 20), "b": (20,)}
REGIONS = {  # a tier covering all of each parameter, and one covering its leading part
    0: {"w": ((0, 12), (0, 20)), "b": ((0, 20),)},
    1: {"w": ((0, 6), (0, 20)), "b": ((0, 10),)}}


def honest(seed: int, common: dict[str, torch.Tensor], noise: float = 1.0):
    """A member's gradient: the round's common direction plus noise of its own."""
    gen = torch.Generator().manual_seed(seed)
    return {n: common[n] + noise * torch.randn(SHAPES[n], generator=gen) for n in SHAPES}


def common_direction(seed: int = 99) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(SHAPES[n], generator=gen) for n in SHAPES}


def encoded(grads: dict[str, torch.Tensor], tier: int, tokens: int,
            encoding: str = "dense") -> list[SparseResult]:
    config = CompressionConfig(encoding=encoding, **(
        {"chunk": 4, "topk": 5} if encoding == "dct" else {}))
    compressor = config.build()
    return [compressor.encode(n, g[region_slices(REGIONS[tier][n])], shape=SHAPES[n],
                              region=REGIONS[tier][n], tokens=tokens)
            for n, g in grads.items()]


def coordinates(r: SparseResult) -> dict[tuple, float]:
    """A result's values by where they lie: element, or (chunk, position) as sent."""
    if r.encoding == "dense":
        index = torch.arange(math.prod(r.shape)).view(r.shape)[region_slices(r.region)]
        return dict(zip(index.reshape(-1).tolist(), r.values.float().reshape(-1).tolist(),
                        strict=True))
    return {(c, i): v for c, row_i, row_v in zip(r.chunks.tolist(), r.indices.tolist(),
                                                  r.values.float().tolist(), strict=True)
            for i, v in zip(row_i, row_v, strict=True)}


def majority(results: dict[str, list[SparseResult]]) -> set[str]:
    """The n // 2 + 1 clients whose cosines with each other client's results sum highest."""
    values = {c: {r.name: coordinates(r) for r in rs} for c, rs in results.items()}
    norm = {c: math.sqrt(sum(v * v for p in ps.values() for v in p.values()))
            for c, ps in values.items()}
    support = dict.fromkeys(results, 0.0)
    for a in results:
        for b in results:
            if a != b:
                dot = sum(v * values[b][name].get(k, 0.0)
                          for name, p in values[a].items() for k, v in p.items())
                support[a] += dot / (norm[a] * norm[b])
    return set(sorted(support, key=support.__getitem__)[-(len(results) // 2 + 1):])


def reference(results: dict[str, list[SparseResult]], counted: set[str]) -> dict[str, float]:
    """The cosine of each client's values with its counted peers' token-weighted sum, over
    the coordinates it sent, built coordinate by coordinate (a dict per parameter)."""
    scores = {}
    for client, sent in results.items():
        dot = own = peers = 0.0
        for result in sent:
            mine = coordinates(result)
            total = dict.fromkeys(mine, 0.0)
            for other, theirs in results.items():
                if other == client or other not in counted:
                    continue
                (match,) = [r for r in theirs if r.name == result.name]
                for key, value in coordinates(match).items():
                    if key in total:
                        total[key] += value * match.tokens
            dot += sum(mine[k] * total[k] for k in mine)
            own += sum(v * v for v in mine.values())
            peers += sum(v * v for v in total.values())
        scores[client] = dot / math.sqrt(own * peers)
    return scores


@pytest.mark.parametrize("encoding", ["dense", "dct"])
def test_a_score_is_the_cosine_with_the_peers_sum_over_the_coordinates_sent(encoding):
    """Members at two tiers (regions of different sizes) and token counts: the cosine built
    coordinate by coordinate, against the three of four whose results agree most with the
    others'."""
    common = common_direction()
    results = {f"m{i}": encoded(honest(i, common), tier, tokens, encoding)
               for i, (tier, tokens) in enumerate([(0, 300), (1, 100), (0, 50), (1, 700)])}
    scores = agreement(results)
    expected = reference(results, majority(results))
    assert set(scores) == set(results) and all(s > 0 for s in scores.values())
    for client, score in scores.items():
        assert score == pytest.approx(expected[client], abs=1e-5), client


@pytest.mark.parametrize("encoding", ["dense", "dct"])
def test_a_sign_flipped_member_at_an_honest_norm_scores_against_its_peers(encoding):
    """Three members, one sending an honest result with its sign flipped: its norm is an
    honest one, so no norm bound sees it; its score is negative and well apart from the
    honest members', which the second pass takes against the agreeing peers only (against
    all peers, an honest member's sum of peers is one honest result minus another)."""
    common = common_direction()
    grads = {f"m{i}": honest(i, common) for i in range(3)}
    grads["m0"] = {n: -g for n, g in grads["m0"].items()}
    results = {c: encoded(g, 0, 100, encoding) for c, g in grads.items()}
    norms = {c: math.sqrt(sum(float(r.values.float().norm()) ** 2 for r in rs))
             for c, rs in results.items()}
    assert max(norms.values()) < 1.2 * min(norms.values())  # the flipped one is not loud
    scores = agreement(results)
    assert scores["m0"] < -0.4 and min(scores["m1"], scores["m2"]) > 0.4, scores
    first = reference(results, set(results))  # one pass: the honest ones near 0
    assert abs(first["m1"]) < 0.2 and abs(first["m2"]) < 0.2, first
    assert majority(results) == {"m1", "m2"}
    second = reference(results, {"m1", "m2"})
    for client, score in scores.items():
        assert score == pytest.approx(second[client], abs=1e-5), client


def test_among_many_members_those_pushing_against_the_rest_score_negative():
    """Beyond PAIRWISE_MAX results the majority is found by each one's cosine with the sum
    of all the others: four of eleven flipped, still caught."""
    common = common_direction()
    grads = {f"m{i}": honest(i, common, noise=2.0) for i in range(11)}
    flipped = {f"m{i}" for i in range(4)}
    for client in flipped:
        grads[client] = {n: -g for n, g in grads[client].items()}
    scores = agreement({c: encoded(g, i % 2, 100, "dct")
                        for i, (c, g) in enumerate(grads.items())})
    assert len(scores) == 11 > PAIRWISE_MAX
    assert max(scores[c] for c in flipped) < 0 < min(
        s for c, s in scores.items() if c not in flipped), scores


def test_two_results_are_not_scored_nor_a_result_without_peers_where_it_sent():
    common = common_direction()
    two = {f"m{i}": encoded(honest(i, common), 0, 100) for i in range(MIN_RESULTS - 1)}
    assert agreement(two) == {}
    three = {**two, "m2": encoded(honest(2, common), 0, 100)}
    three["m2"] = [dataclasses.replace(r, name=f"own.{r.name}") for r in three["m2"]]
    scores = agreement(three)  # m2's parameters are its own: nobody to compare with
    assert set(scores) == {"m0", "m1"}


def member() -> Member:
    return Member(client_id="client-0", name="m0", device_kind="cpu", tier=0, tier_reason="",
                  tokens_per_second=1.0, last_seen=0.0)


def test_the_judge_excludes_on_the_windows_mean_only_once_it_is_full():
    judge = ScoreJudge(FaultsSection(score_rounds=3, min_score=-0.1))
    m = member()
    assert judge.add(m, -0.9) is None and judge.add(m, None) is None  # unscored: no change
    assert m.score is None and m.scores == [-0.9]
    assert judge.add(m, 0.5) is None  # two of three
    why = judge.add(m, -0.9)  # mean -0.433 over the last 3
    assert why == ("its results pointed against its peers': mean agreement -0.433 over its "
                   "last 3 scored rounds, below [faults] min_score -0.1")
    assert m.score == -0.9 and m.score_mean == pytest.approx(-1.3 / 3)
    for score in (0.5, 0.5, 0.5, -0.5):  # the window slides: the old scores leave it
        assert judge.add(m, score) is None
    assert m.scores == [0.5, 0.5, -0.5]
    never = ScoreJudge(FaultsSection(score_rounds=0))
    assert all(never.add(member(), -1.0) is None for _ in range(20))


def test_a_large_round_is_scored_on_a_sample_drawn_anew_each_round(monkeypatch):
    """Beyond SCORED_VALUES a round's values are sampled (every stride-th chunk from a
    random offset): the sampled scores stay near those over every value, and the flipped
    member is caught whichever sample is drawn."""
    common = common_direction()
    grads = {f"m{i}": honest(i, common) for i in range(4)}
    grads["m0"] = {n: -g for n, g in grads["m0"].items()}
    results = {c: encoded(g, 0, 100, "dct") for c, g in grads.items()}
    whole = agreement(results)
    sent = sum(r.values.numel() for rs in results.values() for r in rs)
    monkeypatch.setattr(scores_module, "SCORED_VALUES", sent // 3)  # a stride of 4
    offsets = []
    monkeypatch.setattr(scores_module.secrets, "randbelow",
                        lambda n: offsets.append(n) or len(offsets) % n)
    for _ in range(4):
        sampled = agreement(results)
        assert sampled != whole and sampled["m0"] < 0 < min(sampled["m1"], sampled["m2"])
        assert all(abs(sampled[c] - whole[c]) < 0.25 for c in whole), (sampled, whole)
    assert offsets == [4, 4, 4, 4]
