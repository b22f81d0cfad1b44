"""The adaptive-limits policy: per-regime shrinking on OOM and growing back (no torch)."""

from __future__ import annotations

import pytest

from matformer.modeling.batching import AdaptiveLimitsConfig, MicrobatchLimits, length_regime
from matformer.modeling.errors import BatchDoesNotFit, ConfigError


def _limits(**overrides):
    fields = dict(max_examples=64, max_tokens=4096, stable_steps=3, growth=2.0)
    fields.update(overrides)
    return AdaptiveLimitsConfig(**fields).build()


def test_regimes_are_power_of_two_buckets_of_the_longest_sequence():
    assert [length_regime(n) for n in (1, 2, 3, 4, 5, 512, 513, 1024)] == [
        0, 1, 2, 2, 3, 9, 10, 10
    ]


def test_fresh_regimes_start_at_the_configured_limits_and_hand_out_copies():
    limits = _limits()
    current = limits.limits(100)
    assert current == MicrobatchLimits(max_examples=64, max_tokens=4096)
    current.max_examples = 1
    assert limits.limits(100).max_examples == 64


def test_examples_shrink_first_when_they_bind():
    limits = _limits()
    # 64 rows of 16 tokens: the row limit bound the plan.
    assert limits.shrink(16, rows=64, tokens=1024) == MicrobatchLimits(
        max_examples=32, max_tokens=4096
    )


def test_tokens_shrink_when_rows_did_not_bind_down_to_one_longest_sequence():
    limits = _limits()
    assert limits.shrink(1000, rows=4, tokens=4000).max_tokens == 2000
    assert limits.shrink(1000, rows=2, tokens=2000).max_tokens == 1024  # floor: 2**10
    with pytest.raises(BatchDoesNotFit, match="truncate these sequences"):
        limits.shrink(1000, rows=1, tokens=1000)
    assert limits.limits(1000) == MicrobatchLimits(max_examples=64, max_tokens=1024)


def test_rows_shrink_below_the_limit_when_tokens_are_at_their_floor():
    limits = _limits()
    # longest 600 (floor 1024 tokens); the plan [[600], [400, 300]] ran out of memory.
    assert limits.shrink(600, rows=2, tokens=1200).max_tokens == 1024
    assert limits.shrink(600, rows=2, tokens=800) == MicrobatchLimits(
        max_examples=1, max_tokens=1024
    )
    with pytest.raises(BatchDoesNotFit):
        limits.shrink(600, rows=1, tokens=600)


def test_tokens_shrink_once_examples_reach_their_floor():
    limits = _limits(min_examples=8)
    assert limits.shrink(50, rows=64, tokens=3200) == MicrobatchLimits(
        max_examples=32, max_tokens=4096
    )
    limits.shrink(50, rows=32, tokens=1600)
    limits.shrink(50, rows=16, tokens=800)
    assert limits.limits(50).max_examples == 8
    assert limits.shrink(50, rows=8, tokens=400) == MicrobatchLimits(
        max_examples=8, max_tokens=200
    )
    assert limits.shrink(50, rows=4, tokens=200).max_tokens == 100
    assert limits.shrink(50, rows=2, tokens=100).max_tokens == 64  # floor: 2**6
    with pytest.raises(BatchDoesNotFit):
        limits.shrink(50, rows=1, tokens=50)


def test_regimes_are_independent():
    limits = _limits()
    limits.shrink(600, rows=64, tokens=4000)
    assert limits.limits(1000).max_examples == 32  # 600 and 1000 share regime 10
    assert limits.limits(512).max_examples == 64
    assert limits.limits(16).max_examples == 64


def test_limits_grow_back_after_stable_steps_in_their_own_regime():
    limits = _limits()
    limits.shrink(16, rows=64, tokens=1024)
    limits.shrink(16, rows=32, tokens=512)
    limits.succeeded(16)
    limits.succeeded(16)
    for _ in range(5):
        limits.succeeded(300)  # another regime's successes do not count
    assert limits.limits(16).max_examples == 16
    limits.succeeded(16)
    assert limits.limits(16).max_examples == 32
    limits.succeeded(16)
    limits.shrink(16, rows=32, tokens=512)  # an OOM resets the streak
    limits.succeeded(16)
    limits.succeeded(16)
    assert limits.limits(16).max_examples == 16
    for _ in range(9):
        limits.succeeded(16)
    assert limits.limits(16) == MicrobatchLimits(max_examples=64, max_tokens=4096)  # capped


def test_growth_of_small_limits_always_makes_progress():
    limits = _limits(growth=1.1)
    limits.shrink(1000, rows=4, tokens=4000)
    limits.shrink(1000, rows=2, tokens=2000)
    assert limits.limits(1000).max_tokens == 1024
    for _ in range(3):
        limits.succeeded(1000)
    assert limits.limits(1000).max_tokens == 1126


@pytest.mark.parametrize(
    "fields",
    [
        dict(min_examples=0),
        dict(min_examples=65),
        dict(max_tokens=0),
        dict(stable_steps=0),
        dict(growth=1.0),
    ],
)
def test_config_rejects_limits_that_cannot_work(fields):
    with pytest.raises(ConfigError):
        _limits(**fields)
