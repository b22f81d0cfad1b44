"""The run's work queue: sequence ids in the run's order, plus ids handed back; and how a
round's ids are split among members (`assign`).

Each round takes ids from the front until the round's token budget is met: first the ids
that came back from dropped clients (the latest handed back first), then fresh ids of the
run's order (``modeling.run_order.RunOrder``, the one definition standalone training and
evaluation share): its training sequences, epoch after epoch in a fresh order each, never
the held-out tail. Everything here is a function of its state (``position`` and
``requeued``), so replaying the same events gives the same rounds.

A round's ids are split into consecutive runs, one per member, sized in proportion to the
speed it has shown (`assign`): deterministic, disjoint and covering, with no randomness of
its own, since the order already is shuffled.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from matformer.modeling.mdat import Mdat, SequenceReader
from matformer.modeling.mdat.checkpoint_tokenizer import (
    SPECIAL_ID_NAMES,
    check_special_ids,
    special_ids,
)
from matformer.modeling.run_order import RunOrder
from matformer.modeling.training import with_targets
from matformer.server.config import RunConfig
from matformer.server.errors import ShardError
from matformer.server.state import RunState


def work_order(mdat: Mdat, config: RunConfig, state: RunState | None = None
               ) -> tuple[SequenceReader, RunOrder]:
    """The run's sequences (its [data]) and its order. BatchError if no sequence carries a
    target; ConfigError if the strategy gives ids the model has no embedding for, or
    (SpecialIdsMismatch) if a pretrained model's special ids are not the data's.

    ``state`` (the saved run, if any) keeps a run's order what it was, since its queue
    positions count in it: a run saved before orders held out a tail (its state has no
    ``held_out``) goes on over the same order every epoch, the one it began with (the
    shuffle's ids that carry a target, or, saved before those were left out, the whole
    shuffle).
    """
    data, model = config.data, config.model.build()
    strategy = mdat.strategy(data.strategy)
    strategy.fit_vocabulary(model, named=True)
    if config.model.checkpoint is not None:  # its embeddings learned its own special ids
        check_special_ids({name: getattr(model, name) for name in SPECIAL_ID_NAMES},
                          special_ids(mdat.path, strategy),
                          f"[data] {mdat.path} ({data.strategy!r})")
    if state is None or state.held_out is not None:
        return RunOrder.open(mdat, data.strategy, data.max_seq_len, data.view, data.seed, model)
    reader = mdat.sequences(data.strategy, data.max_seq_len, data.view)
    shuffle = mdat.shuffle(data.view, data.strategy, data.max_seq_len, data.seed)
    if state.sequences is None:
        return reader, RunOrder.fixed(shuffle)
    return reader, RunOrder.fixed(with_targets(shuffle, reader.lengths(), model))


class WorkQueue:
    def __init__(self, order: RunOrder, *, position: int = 0,
                 requeued: Iterable[int] = ()) -> None:
        self.order = order
        self.position = position  # fresh ids handed out so far (over all epochs)
        self.requeued = [int(i) for i in requeued]  # handed back, served before fresh ids

    def take(self, budget_tokens: int, length_of: Callable[[int], int]) -> list[int]:
        """Ids from the front whose lengths sum to at most ``budget_tokens`` (at least one)."""
        taken: list[int] = []
        total = 0
        while True:
            fresh = not self.requeued
            nxt = self.order.at(self.position) if fresh else self.requeued[0]
            size = length_of(nxt)
            if taken and total + size > budget_tokens:
                return taken
            taken.append(nxt)
            total += size
            if fresh:
                self.position += 1
            else:
                self.requeued.pop(0)

    def snapshot(self) -> tuple[int, list[int]]:
        return self.position, list(self.requeued)

    def restore(self, snapshot: tuple[int, list[int]]) -> None:
        self.position, self.requeued = snapshot[0], list(snapshot[1])

    def requeue(self, ids: Iterable[int]) -> None:
        """Put ``ids`` back at the front, ahead of anything handed back earlier."""
        self.requeued[:0] = [int(i) for i in ids]

    def to_dict(self) -> dict[str, Any]:
        return {"position": self.position, "requeued": list(self.requeued)}


def assign(
    ids: Sequence[int] | np.ndarray, shares: Sequence[tuple[str, float]],
    owed: dict[str, float] | None = None,
) -> dict[str, np.ndarray]:
    """Split ``ids`` into consecutive runs, one per client, sized in proportion to its share.

    Sizes are rounded by largest remainder (ties to the earlier client), so they sum to
    ``len(ids)`` exactly; clients keep the order given. Every id goes to exactly one client.
    ``owed``: what rounding left each client short (+) or over (-) in earlier splits, in ids;
    added to its exact size here and updated in place. Over many splits every client then
    gets its share to within one id, where rounding each split alone can leave a small
    share 10-20% off every time (a speed-1/4 member of 6 ids, one round after another).
    """
    clients = [client for client, _ in shares]
    weights = [share for _, share in shares]
    if not shares or len(set(clients)) != len(clients):
        raise ShardError(f"shares must name at least one client, each once; got {clients}.")
    if not all(math.isfinite(w) and w >= 0 for w in weights) or sum(weights) <= 0:
        raise ShardError(f"shares must be finite, >= 0 and not all 0; got {weights}.")
    ids = np.asarray(ids)
    exact = [len(ids) * w / sum(weights) for w in weights]
    if owed is not None:  # clients no longer splitting owe and are owed nothing
        carried = [owed.get(client, 0.0) if w > 0 else 0.0 for client, w in shares]
        adjusted = [max(x + c, 0.0) for x, c in zip(exact, carried, strict=True)]
        exact = [x * len(ids) / sum(adjusted) for x in adjusted] if sum(adjusted) else exact
    sizes = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (sizes[i] - exact[i], i))
    for i in by_remainder[: len(ids) - sum(sizes)]:
        sizes[i] += 1
    if owed is not None:
        owed.clear()
        owed.update({client: x - n for client, x, n in zip(clients, exact, sizes, strict=True)})
    bounds = np.cumsum([0, *sizes])
    return {client: ids[bounds[i]:bounds[i + 1]] for i, client in enumerate(clients)}
