"""Splitting a round's ids among members by their shares: sizes, requeued ids, bad shares."""

import numpy as np
import pytest

from matformer.server.errors import ShardError
from matformer.server.work import assign


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


def test_what_rounding_owes_a_client_is_paid_in_later_splits() -> None:
    """Members of speeds 1, 1/2, 1/4 and 1 split 64 ids a round: alone, each split rounds
    the same way (12 and 6 ids for shares of 11.6 and 5.8, 23 for 23.3), so the slow members
    compute 3% longer than their share every round while the others wait; carrying what
    rounding owes keeps every member's total within one id of its share."""
    shares = [("a", 1.0), ("b", 0.5), ("c", 0.25), ("d", 1.0)]
    exact = {client: 64 * w / 2.75 for client, w in shares}
    alone = {client: 0 for client, _ in shares}
    carried = dict(alone)
    owed: dict[str, float] = {}
    for split in range(1, 41):
        for got, kept in ((alone, None), (carried, owed)):
            sizes = {c: len(ids) for c, ids in assign(np.arange(64), shares, kept).items()}
            assert sum(sizes.values()) == 64
            assert all(abs(n - exact[c]) < 2 for c, n in sizes.items())  # never far off
            for client, n in sizes.items():
                got[client] += n
        assert all(abs(carried[c] - split * exact[c]) < 1 for c in exact)
    assert max(abs(alone[c] - 40 * exact[c]) for c in exact) > 5  # drift, without it
    # a member that leaves is owed nothing; one that joins starts even
    assign(np.arange(64), [("a", 1.0), ("e", 1.0)], owed)
    assert set(owed) == {"a", "e"} and abs(sum(owed.values())) < 1e-9
