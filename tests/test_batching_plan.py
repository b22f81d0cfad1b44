"""Token-budget batch planning and microbatch splitting: pure index arithmetic."""

from __future__ import annotations

import random

import pytest

from matformer.modeling.batching import padded_tokens, plan_batches, split_microbatches
from matformer.modeling.errors import BatchError, ConfigError, SequenceTooLong

LENGTHS = [3, 9, 2, 4, 8, 1, 1, 1]


def _random_lengths(count: int, seed: int) -> list[int]:
    draw = random.Random(seed)
    return [draw.choice([1, 2, 3, 5, 8, 13, 40, 64]) for _ in range(count)]


def _assert_partition(groups: list[list[int]], count: int) -> None:
    flat = [i for group in groups for i in group]
    assert sorted(flat) == list(range(count))  # nothing dropped, nothing repeated
    assert all(groups)


def test_padded_tokens_is_rows_times_longest():
    assert padded_tokens([3, 9, 2]) == 27
    assert padded_tokens([]) == 0


def test_plan_without_a_window_keeps_data_order_and_closes_batches_at_the_budget():
    assert plan_batches(LENGTHS, 12, sort_window=0) == [[0], [1], [2, 3], [4], [5, 6, 7]]


def test_plan_short_sequences_pack_densely_and_long_ones_shrink_the_batch():
    assert plan_batches([2] * 10 + [10, 10, 10], 20, sort_window=0) == [
        list(range(10)), [10, 11], [12]
    ]


def test_plan_sorts_within_windows_of_batches_worth_of_tokens():
    # sort_window=2 → runs of ≤ 24 tokens: [3, 9, 2, 4] → 9 | 4 3 2; [8, 1, 1, 1] → 8 | 1 1 1.
    assert plan_batches(LENGTHS, 12, sort_window=2) == [[1], [0, 2, 3], [4], [5, 6, 7]]
    # sort_window=1 → runs of ≤ 12 tokens: [3, 9], [2, 4], [8, 1, 1, 1].
    assert plan_batches(LENGTHS, 12, sort_window=1) == [[1], [0], [2, 3], [4], [5, 6, 7]]
    # A window wider than the data sorts it all: 9 | 8 | 4 3 2 | 1 1 1.
    assert plan_batches(LENGTHS, 12, sort_window=100) == [[1], [4], [0, 2, 3], [5, 6, 7]]


def _runs(lengths: list[int], tokens: int) -> list[int]:
    """Run number of each sequence: consecutive runs of ≤ ``tokens`` tokens (or one sequence)."""
    runs, run, total = [], 0, 0
    for size in lengths:
        if total and total + size > tokens:
            run, total = run + 1, 0
        runs.append(run)
        total += size
    return runs


@pytest.mark.parametrize("sort_window", [0, 1, 4, 16, 1000])
def test_plan_covers_everything_within_budget(sort_window):
    lengths = _random_lengths(300, seed=sort_window)
    batches = plan_batches(lengths, 128, sort_window=sort_window)
    _assert_partition(batches, len(lengths))
    assert all(padded_tokens([lengths[i] for i in b]) <= 128 for b in batches)
    assert all(b == sorted(b) for b in batches)
    if sort_window:  # no batch mixes two runs, and runs keep their data order
        runs = _runs(lengths, sort_window * 128)
        batch_runs = [{runs[i] for i in b} for b in batches]
        assert all(len(r) == 1 for r in batch_runs)
        assert [min(r) for r in batch_runs] == sorted(min(r) for r in batch_runs)
    else:
        assert [i for b in batches for i in b] == list(range(len(lengths)))


def test_sorting_within_windows_cuts_padding():
    lengths = _random_lengths(400, seed=1)
    waste = {}
    for window in (0, 16):
        waste[window] = _padding(lengths, plan_batches(lengths, 256, sort_window=window))
    assert waste[16] < 0.1 < 0.5 < waste[0]  # measured: 8% and 60%


def _log_uniform_lengths(count: int, longest: int, seed: int) -> list[int]:
    draw = random.Random(seed)
    return [int(longest ** draw.random()) for _ in range(count)]  # in [1, longest)


def _padding(lengths: list[int], batches: list[list[int]]) -> float:
    """Share of the padded tokens that are padding."""
    padded = sum(padded_tokens([lengths[i] for i in b]) for b in batches)
    return 1 - sum(lengths) / padded


def test_the_default_window_cuts_padding_far_below_data_order():
    lengths = _log_uniform_lengths(5000, 512, seed=0)
    default = _padding(lengths, plan_batches(lengths, 4096))
    data_order = _padding(lengths, plan_batches(lengths, 4096, sort_window=0))
    assert default < 0.15 < 0.6 < data_order  # measured: 12% and 74%


def test_plan_rejects_a_sequence_longer_than_the_budget():
    with pytest.raises(SequenceTooLong, match="raise max_tokens to at least 13"):
        plan_batches([4, 13, 2], 12)


def test_plan_rejects_bad_input():
    with pytest.raises(BatchError, match="drop empty"):
        plan_batches([4, 0], 12)
    with pytest.raises(ConfigError):
        plan_batches([4], 0)
    with pytest.raises(ConfigError):
        plan_batches([4], 8, sort_window=-1)
    assert plan_batches([], 8) == []


def test_split_sorts_longest_first_and_respects_both_limits():
    assert split_microbatches(LENGTHS, max_tokens=9, max_examples=3) == [
        [1], [4], [3, 0], [2, 5, 6], [7]
    ]
    assert split_microbatches(LENGTHS, max_tokens=100, max_examples=100) == [
        [1, 4, 3, 0, 2, 5, 6, 7]
    ]


@pytest.mark.parametrize(("max_tokens", "max_examples"), [(64, 1), (64, 4), (100, 3), (500, 64)])
def test_split_covers_the_batch_within_limits(max_tokens, max_examples):
    lengths = _random_lengths(60, seed=max_tokens + max_examples)
    parts = split_microbatches(lengths, max_tokens=max_tokens, max_examples=max_examples)
    _assert_partition(parts, len(lengths))
    for part in parts:
        assert len(part) <= max_examples
        assert padded_tokens([lengths[i] for i in part]) <= max_tokens
    # Longest first: no later microbatch holds a row longer than an earlier one's shortest.
    order = [lengths[i] for part in parts for i in part]
    assert order == sorted(order, reverse=True)


def test_microbatches_of_a_planned_batch_pad_to_at_most_its_budget():
    lengths = _random_lengths(200, seed=3)
    for batch in plan_batches(lengths, 256):
        sizes = [lengths[i] for i in batch]
        for max_tokens in (64, 100, 256):
            parts = split_microbatches(sizes, max_tokens=max_tokens, max_examples=8)
            assert sum(padded_tokens([sizes[i] for i in p]) for p in parts) <= 256


def test_split_rejects_rows_over_the_token_limit_and_bad_limits():
    with pytest.raises(SequenceTooLong, match="at least 9"):
        split_microbatches(LENGTHS, max_tokens=8, max_examples=4)
    with pytest.raises(ConfigError):
        split_microbatches(LENGTHS, max_tokens=16, max_examples=0)
