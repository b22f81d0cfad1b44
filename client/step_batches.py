"""The batch of each step of a standalone run: its rows, and the sequences this process reads
for them, read ahead by background workers (``--num-workers``) while earlier steps train.

The workers are threads. A sequence is a slice of a memory-mapped ``.npy`` array, which numpy
copies without holding the GIL, and the open container holds LMDB environments that a forked
process must not touch; threads share the open reader, pickle nothing, and hand their tensors
over as they are. A worker makes the step's rows too (``Epochs``: an epoch's plan is made by
the first worker that needs it). The microbatches a step is cut into are left to the runner,
whose limits may shrink on the step just before. Steps come back in order, with what reading
them in the training loop would give: only where the reading happens changes.

Under data parallelism a rank reads only the sequences of its share of the step's rows: the
share ``DataParallel.share`` gives from the rows' token counts, which ``tier_gradients`` takes
again from the same counts. The other ranks' sequences are stand-ins of the right length and
no memory, filled with -1 so that any use of one fails loudly in the embedding.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from matformer.client.epochs import Epochs
from matformer.modeling.distributed import DataParallel

PREFETCH_FACTOR = 2  # steps read ahead per worker, as torch's DataLoader prefetches


class StepBatch(NamedTuple):
    ids: np.ndarray  # (sequences,) the step's sequence ids
    rows: list[list[int]]  # each row's positions into ids
    examples: list[Tensor]  # one per id: its tokens, or a stand-in where another rank reads it


class StepBatches:
    """The steps of ``epochs``; ``read(ids)`` gives the tokens of ``ids`` (CPU tensors),
    ``lengths[id]`` each sequence's length without reading it."""

    def __init__(self, epochs: Epochs, lengths: np.ndarray,
                 read: Callable[[np.ndarray], list[Tensor]], *, workers: int = 0,
                 parallel: DataParallel | None = None) -> None:
        self.epochs, self.lengths, self.read = epochs, lengths, read
        self.workers, self.parallel = workers, parallel

    def mine(self, ids: np.ndarray, rows: list[list[int]]) -> list[int]:
        """Positions into ``ids`` of the sequences this rank trains (all, in one process)."""
        if self.parallel is None:
            return list(range(len(ids)))
        sizes = [int(self.lengths[ids[row]].sum()) for row in rows]
        return sorted(i for r in self.parallel.share(sizes) for i in rows[r])

    def steps(self, first: int, total: int, device: torch.device) -> Iterator[StepBatch]:
        """Steps ``first`` to ``total - 1`` in order, on ``device``; with workers, at most
        ``PREFETCH_FACTOR`` steps per worker read ahead of the one handed out."""
        if not self.workers:
            for step in range(first, total):
                yield self._on(device, *self._load(step))
            return
        pool = ThreadPoolExecutor(self.workers, thread_name_prefix="matformer-data")
        upcoming = iter(range(first, total))
        pending: deque[Future] = deque(
            pool.submit(self._load, step)
            for step in itertools.islice(upcoming, self.workers * PREFETCH_FACTOR))
        try:
            while pending:
                loaded = pending.popleft().result()
                pending.extend(pool.submit(self._load, step)
                               for step in itertools.islice(upcoming, 1))
                yield self._on(device, *loaded)
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _load(self, step: int) -> tuple[np.ndarray, list[list[int]], list[int], list[Tensor]]:
        ids, rows = self.epochs.step(step)
        mine = self.mine(ids, rows)
        return ids, rows, mine, self.read(ids[mine])

    def _on(self, device: torch.device, ids: np.ndarray, rows: list[list[int]],
            mine: list[int], read: list[Tensor]) -> StepBatch:
        examples: list[Tensor | None] = [None] * len(ids)
        for position, tokens in zip(mine, read, strict=True):
            examples[position] = tokens.to(device)
        unread = torch.full((), -1, dtype=torch.int64, device=device)
        return StepBatch(ids, rows, [unread.expand(int(self.lengths[ids[i]])) if e is None else e
                                     for i, e in enumerate(examples)])
