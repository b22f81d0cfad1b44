"""Splitting a round's ids among members by their shares: sizes, requeued ids, bad shares."""

import numpy as np
import pytest

from server.errors import ShardError
from server.work import assign


def test_shard_sizes_follow_the_shares() -> None:
    shards = assign(np.random.default_rng(0).permutation(1000),
                    [("big", 3.0), ("small", 1.0), ("mid", 2.0)])
    assert {k: len(v) for k, v in shards.items()} == {"big": 500, "small": 167, "mid": 333}


def test_rounds_and_requeue() -> None:
    first = assign(np.arange(100, 130), [("a", 1.0), ("b", 1.0), ("c", 1.0)])
    requeued = assign(first["b"], [("a", 1.0), ("c", 1.0)])  # b dropped out
    assert sorted(np.concatenate([first["a"], first["c"], *requeued.values()]).tolist()) == list(
        range(100, 130))
    assert assign([], [("a", 1.0)])["a"].tolist() == []


@pytest.mark.parametrize("shares", [[], [("a", 1.0), ("a", 2.0)], [("a", -1.0)], [("a", 0.0)],
                                    [("a", float("nan"))]])
def test_bad_shares(shares) -> None:
    with pytest.raises(ShardError):
        assign([1, 2, 3], shares)
