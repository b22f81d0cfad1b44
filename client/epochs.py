"""The steps of a standalone run: which sequences each optimizer step trains, epoch after
epoch, packed into rows or one sequence a row (``--batching``)."""

from __future__ import annotations

import argparse
import threading

import numpy as np

from matformer.modeling.batching import plan_batches, plan_packed
from matformer.modeling.errors import ConfigError
from matformer.modeling.run_order import RunOrder

DEFAULT_STEPS = 200


def plan(lengths: list[int], args: argparse.Namespace) -> list[list[list[int]]]:
    """Each step's rows (index lists into ``lengths``): packed, or one sequence a row."""
    if args.batching == "packed":
        return plan_packed(lengths, args.batch_tokens, args.seq_len)
    return [[[i] for i in batch] for batch in plan_batches(
        lengths, args.batch_tokens, pad_to_multiple_of=getattr(args, "pad_to_multiple_of", 1))]


class Epochs:
    """The steps of a run over ``order``'s training sequences, one epoch after another, each
    in the order ``RunOrder.epoch`` gives it (the same every time a run is run or
    resumed)."""

    def __init__(self, order: RunOrder, lengths: np.ndarray, args: argparse.Namespace) -> None:
        self.order, self.lengths, self.args = order, lengths, args
        self._plans: list[list[list[list[int]]]] = []
        # data workers (``StepBatches``) ask for steps from several threads: one plans at a time
        self._planning = threading.Lock()

    def epoch(self, number: int) -> tuple[np.ndarray, list[list[list[int]]]]:
        """(sequence ids in the epoch's order, its steps' rows as positions in that order)."""
        with self._planning:
            while len(self._plans) <= number:
                ids = self.order.epoch(len(self._plans))
                self._plans.append(plan(self.lengths[ids].tolist(), self.args))
            return self.order.epoch(number), self._plans[number]

    def steps(self) -> int:
        """The run's steps: ``--steps``, or ``--epochs`` whole epochs, or 200."""
        steps, epochs = self.args.steps, self.args.epochs
        if steps is not None and epochs is not None:
            raise ConfigError("give --steps or --epochs, not both.")
        if epochs is not None:
            if epochs < 1:
                raise ConfigError(f"--epochs must be at least 1, got {epochs}.")
            return sum(len(self.epoch(n)[1]) for n in range(epochs))
        return DEFAULT_STEPS if steps is None else steps

    def step(self, index: int) -> tuple[np.ndarray, list[list[int]]]:
        """(the step's sequence ids, its rows as positions into those ids)."""
        number = 0
        while index >= len(self.epoch(number)[1]):
            index -= len(self.epoch(number)[1])
            number += 1
        order, rows = self.epoch(number)
        batch = [i for row in rows[index] for i in row]
        position = {i: n for n, i in enumerate(batch)}
        return order[batch], [[position[i] for i in row] for row in rows[index]]
