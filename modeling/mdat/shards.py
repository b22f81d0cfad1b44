"""Splitting sequence ids among clients: deterministic, disjoint, covering.

A coordinator takes each round's ids from the front of a shuffled order (its work queue,
``server/work.py``), then splits them by the clients' shares (`assign`). Ids a dropped client
held go back to the front of the queue and are split again in a later round. No randomness
is involved: the order already is shuffled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from modeling.errors import ShardError


def assign(
    ids: Sequence[int] | np.ndarray, shares: Sequence[tuple[str, float]]
) -> dict[str, np.ndarray]:
    """Split ``ids`` into consecutive runs, one per client, sized in proportion to its share.

    Sizes are rounded by largest remainder (ties to the earlier client), so they sum to
    ``len(ids)`` exactly; clients keep the order given. Every id goes to exactly one client.
    """
    clients = [client for client, _ in shares]
    weights = [share for _, share in shares]
    if not shares or len(set(clients)) != len(clients):
        raise ShardError(f"shares must name at least one client, each once; got {clients}.")
    if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise ShardError(f"shares must be finite, >= 0 and not all 0; got {weights}.")
    ids = np.asarray(ids)
    exact = [len(ids) * w / sum(weights) for w in weights]
    sizes = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (sizes[i] - exact[i], i))
    for i in by_remainder[: len(ids) - sum(sizes)]:
        sizes[i] += 1
    bounds = np.cumsum([0, *sizes])
    return {client: ids[bounds[i]:bounds[i + 1]] for i, client in enumerate(clients)}
