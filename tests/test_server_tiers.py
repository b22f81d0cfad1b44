"""Tier assignment: the memory estimate by hand, then each rule of the policy.

The model: V=260, C=64, L=2, 4 heads (k/v at full width), base FFN width 256, untied.
Non-FFN parameters: embed 260·64 + lm_head 260·64 + 2 layers × (4·64·64 + 2·64) + 64 = 66368.
FFN parameters at width w: 2 layers × 3·64·w = 384·w.
Activations per token: L·(8·C + 4·w) + 2·C + 2·V = 1672 + 8·w.
"""

from __future__ import annotations

import re

import grpc
import pytest
from support.helpers import run_tables, write_run_toml

from matformer.modeling.config import ModelConfig
from matformer.modeling.mdat import build_default_mdat
from matformer.server.config import RunConfig
from matformer.server.errors import (
    BadCapabilities,
    InvalidValue,
    NoAllowedTier,
    NoTierFits,
    PinnedTierDoesNotFit,
    TierAssignmentError,
)
from matformer.server.memory import TrainingMemory
from matformer.server.sections import TiersSection
from matformer.server.tiers import Capabilities, TierPolicy

MODEL = ModelConfig(vocab_size=260, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                    intermediate_size=256, max_position_embeddings=64)
MiB, GiB = 2**20, 2**30
TOKENS = 1024
# 16·N_t + 4·T·(1672 + 8·w_t) at T = 1024
NEED = {
    0: 16 * (66368 + 384 * 256) + 4 * TOKENS * (1672 + 8 * 256),  # 17_871_872 B ≈ 17.0 MiB
    1: 16 * (66368 + 384 * 128) + 4 * TOKENS * (1672 + 8 * 128),  # 12_891_136 B ≈ 12.3 MiB
    2: 16 * (66368 + 384 * 64) + 4 * TOKENS * (1672 + 8 * 64),  # 10_400_768 B ≈ 9.9 MiB
}


@pytest.fixture(scope="module")
def memory() -> TrainingMemory:
    return TrainingMemory(MODEL)


@pytest.fixture(scope="module")
def policy() -> TierPolicy:
    return TierPolicy(MODEL, allowed=[0, 1, 2], pins={}, mix={})


def client(memory: int, *, name: str = "laptop", requested: int | None = None,
           tokens: int = TOKENS) -> Capabilities:
    return Capabilities(name=name, device_kind="cpu", memory_bytes=memory,
                        requested_tier=requested, tokens_per_second=1000.0,
                        microbatch_tokens=tokens)


def test_parameters_shared_whole_and_ffn_at_tier_width(memory):
    assert [memory.parameters(t) for t in range(3)] == [164672, 115520, 90944]


def test_training_bytes_by_hand(memory):
    assert {t: memory.training_bytes(t, TOKENS) for t in range(3)} == NEED
    assert NEED == {0: 17_871_872, 1: 12_891_136, 2: 10_400_768}


def test_sliced_config_estimates_like_its_universal_config():
    sliced = ModelConfig(vocab_size=260, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=4, intermediate_size=128, matformer_tier=1,
                         max_position_embeddings=64)
    assert TrainingMemory(sliced).training_bytes(0, TOKENS) == NEED[0]


def test_largest_tier_that_fits(policy):
    big = policy.assign(client(20 * MiB))
    assert (big.tier, big.ffn_width, big.estimated_bytes) == (0, 256, NEED[0])
    assert big.reason == ("tier 0 (FFN 256): the largest allowed tier; needs 17.0 MiB of the "
                          "20.0 MiB the client reports")
    mid = policy.assign(client(15 * MiB))
    assert (mid.tier, mid.ffn_width) == (1, 128)
    assert mid.reason == "tier 1 (FFN 128): tier 0 needs 17.0 MiB, the client reports 15.0 MiB"
    assert policy.assign(client(11 * MiB)).tier == 2
    assert policy.assign(client(NEED[2])).tier == 2  # exactly enough fits


def test_reason_in_gib(policy):
    # tier 0 at 100k tokens: 16·164672 + 4·100000·3720 = 1_490_634_752 B ≈ 1.4 GiB
    got = policy.assign(client(int(1.2 * GiB), tokens=100_000))
    assert got.reason == "tier 1 (FFN 128): tier 0 needs 1.4 GiB, the client reports 1.2 GiB"


def test_nothing_fits_names_smallest_need_and_memory(policy):
    with pytest.raises(NoTierFits, match=r"tier 2 \(FFN 64\), needs 9\.9 MiB at 1024 tokens "
                                         r"per microbatch and it reports 9\.0 MiB"):
        policy.assign(client(9 * MiB))


def test_requested_tier_bounds_the_size(policy):
    got = policy.assign(client(GiB, requested=1))
    assert got.tier == 1
    assert got.reason.startswith("tier 1 (FFN 128): the tier the client asked for; needs 12.3 MiB")
    assert policy.assign(client(15 * MiB, requested=1)).tier == 1
    assert policy.assign(client(11 * MiB, requested=1)).tier == 2
    with pytest.raises(NoAllowedTier, match=r"asked for tier 3 or smaller.*tiers \[0, 1, 2\]"):
        policy.assign(client(GiB, requested=3))


def test_allowed_tiers_only():
    policy = TierPolicy(MODEL, allowed=[2, 0], pins={}, mix={})
    got = policy.assign(client(15 * MiB))
    assert got.tier == 2
    assert got.reason == "tier 2 (FFN 64): tier 0 needs 17.0 MiB, the client reports 15.0 MiB"
    asked_for_missing_tier = policy.assign(client(GiB, requested=1))
    assert asked_for_missing_tier.tier == 2
    assert "the largest allowed tier" in asked_for_missing_tier.reason


def test_pin_overrides_request_memory_rule_and_mix():
    policy = TierPolicy(MODEL, allowed=[0, 1, 2], pins={"alice": 2, "bob": 0},
                        mix={0: 1.0})
    got = policy.assign(client(GiB, name="alice", requested=0))
    assert (got.tier, got.ffn_width, got.estimated_bytes) == (2, 64, NEED[2])
    assert got.reason == ("tier 2 (FFN 64): pinned by [tiers.pins]; needs 9.9 MiB of the "
                          "1.0 GiB it reports")
    with pytest.raises(PinnedTierDoesNotFit, match=r"'bob' is pinned to tier 0 \(FFN 256\), "
                                                   r"which needs 17\.0 MiB"):
        policy.assign(client(15 * MiB, name="bob"))


def test_mix_prefers_the_tier_furthest_below_its_target():
    policy = TierPolicy(MODEL, allowed=[0, 1, 2], pins={}, mix={0: 0.25, 1: 0.25, 2: 0.5})
    first = policy.assign(client(GiB))
    assert first.tier == 2  # nobody yet: 0.5 is the largest deficit
    assert first.reason == ("tier 2 (FFN 64): the target mix wants 50% at tier 2; no member has "
                            "joined yet")
    # deficits 0.25, 0.25, -0.5: a tie, the larger model wins
    assert policy.assign(client(GiB), members=[2, 2]).tier == 0
    # deficits -0.25, 0.25, 0.0
    got = policy.assign(client(GiB), members=[0, 2])
    assert got.tier == 1
    assert got.reason.endswith("wants 25% at tier 1; 0% of the 2 members have it")
    # tier 0 does not fit: of 1 (0.25) and 2 (-0.5), tier 1
    assert policy.assign(client(15 * MiB), members=[2, 2]).tier == 1


def test_mix_thirds_tie_to_the_larger_model():
    third = 1 / 3
    policy = TierPolicy(MODEL, allowed=[0, 1, 2], pins={}, mix={0: third, 1: third, 2: third})
    assert policy.assign(client(GiB), members=[0, 1, 2]).tier == 0


def test_section_builds_the_policy():
    policy = TiersSection(allowed=[1, 2], pins={"x": 1}).build(MODEL)
    assert policy.assign(client(GiB, name="x")).tier == 1
    assert policy.assign(client(GiB)).tier == 1


@pytest.mark.parametrize("bad", [dict(memory=0), dict(memory=GiB, tokens=0),
                                 dict(memory=GiB, requested=-1)])
def test_bad_capabilities(policy, bad):
    with pytest.raises(BadCapabilities):
        policy.assign(client(**bad))


def test_errors_carry_grpc_codes():
    assert NoTierFits.code == grpc.StatusCode.FAILED_PRECONDITION
    assert BadCapabilities.code == grpc.StatusCode.INVALID_ARGUMENT
    assert issubclass(PinnedTierDoesNotFit, TierAssignmentError)


# [tiers] layer_mixes: Mix'n'Match slices as tiers 64, 65, ... Layer 0 at tier 1 (w 128),
# layer 1 at tier 2 (w 64): FFN parameters 192·128 + 192·64, activations per token
# 2·8·64 + 4·(128 + 64) + 2·64 + 2·260 = 2440.
MIXED = TiersSection(allowed=[0, 1, 2], layer_mixes=[[1, 2], [0, 2]])
NEED_MIX = 16 * (66368 + 192 * 128 + 192 * 64) + 4 * TOKENS * 2440


def test_a_mix_is_a_tier_estimated_layer_by_layer():
    policy = MIXED.build(MODEL)
    assert policy.memory.parameters(64) == 66368 + 192 * (128 + 64)
    assert policy.memory.training_bytes(64, TOKENS) == NEED_MIX
    # by size, largest first: 0, then mix [0, 2] (256 + 64), 1 (128 + 128), mix [1, 2], 2
    assert policy.allowed == [0, 65, 1, 64, 2]
    assert MIXED.ids() == [0, 1, 2, 64, 65]


def test_a_mix_is_assigned_moved_and_pinned_as_a_tier():
    policy = MIXED.build(MODEL)
    fits = policy.assign(client(NEED_MIX, name="a"))  # tier 1 needs more, mix [1, 2] fits
    assert (fits.tier, fits.ffn_width) == (64, 128)
    assert fits.reason.startswith("tier 64 (mix:1,2, FFN 128/64): tier 1 needs 12.3 MiB")
    # asking for tier 1 or smaller: mix [0, 2] is larger on layer 0, so not a candidate
    assert policy.assign(client(GiB, requested=1)).tier == 1
    assert policy.assign(client(GiB, requested=2)).tier == 2
    assert policy.moved(name="a", tier=64, step=1, requested_tier=None, memory_bytes=0,
                        microbatch_tokens=TOKENS) == 2
    assert policy.moved(name="a", tier=1, step=1, requested_tier=None, memory_bytes=0,
                        microbatch_tokens=TOKENS) == 64
    assert policy.moved(name="a", tier=1, step=-1, requested_tier=1, memory_bytes=0,
                        microbatch_tokens=TOKENS) is None  # mix [0, 2] is past the request
    pinned = TiersSection(allowed=[0, 1, 2], layer_mixes=[[1, 2]], pins={"p": 64},
                          mix={64: 0.5, 0: 0.5}).build(MODEL)
    assert pinned.assign(client(GiB, name="p")).tier == 64
    assert pinned.assign(client(GiB, name="q"), members=[0]).tier == 64  # the mix's share


@pytest.mark.parametrize("mixes, pins, words", [
    ([[1, 3]], {}, "uses a tier that is not in allowed [0, 1, 2]"),
    ([[2, 1]], {}, "grows wider with depth"),
    ([[1, 1]], {}, "is tier 1 on every layer; list that tier in allowed instead"),
    ([[1, 2], [1, 2]], {}, "is listed twice"),
    ([[1, 2]], {"p": 65}, "pins 'p' to tier 65, which is not one of the run's tiers [0, 1, 2, 64]"),
])
def test_bad_layer_mixes_are_refused_by_name(mixes, pins, words):
    with pytest.raises(InvalidValue, match=re.escape(words)):
        TiersSection(allowed=[0, 1, 2], layer_mixes=mixes, pins=pins)


def test_a_mix_of_the_wrong_length_is_refused_with_the_model(tmp_path):
    mdat = build_default_mdat(tmp_path / "d.mdat", limit=4)
    mdat.close()
    tables = run_tables(tmp_path / "d.mdat", tiers={"allowed": [0, 1], "layer_mixes": [[0, 1, 1]]})
    with pytest.raises(InvalidValue, match=re.escape(
            "[tiers] layer_mixes[0]: a Mix'n'Match tier list needs one tier per layer (2), got 3")):
        RunConfig.load(write_run_toml(tmp_path / "run.toml", tables))
