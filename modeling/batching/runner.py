"""Run a batch's microbatches under adaptive limits, retrying after out-of-memory errors.

One call handles one batch: plan microbatches with the limits of the batch's length regime,
run them, and on ``torch.OutOfMemoryError`` clear the gradients of the failed attempt, free
cached GPU memory, shrink that regime's limits and retry the same batch. No example is
dropped and no half-accumulated gradient survives, so the gradient afterwards is exactly
the one a single successful attempt gives. Only out-of-memory errors are caught: anything
else propagates untouched. (A failed CPU allocation is a plain RuntimeError in torch, not
an OutOfMemoryError, and propagates too.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import Tensor

from matformer.modeling.batching.accumulate import AccumulatedLoss, accumulate_gradients
from matformer.modeling.batching.cost import padded_tokens
from matformer.modeling.batching.limits import AdaptiveLimits
from matformer.modeling.batching.microbatches import split_microbatches
from matformer.modeling.devices import Precision
from matformer.modeling.errors import BatchDoesNotFit, BatchError
from matformer.modeling.matformer import Tier
from matformer.modeling.models import AutoregressiveModel

Result = TypeVar("Result")
Attempt = Callable[[list[list[int]]], Result]  # microbatches (index lists) → result


class MicrobatchRunner:
    """Accumulates each batch's gradient in microbatches sized by ``limits``."""

    def __init__(self, model: AutoregressiveModel, limits: AdaptiveLimits) -> None:
        self.model = model
        self.limits = limits

    @property
    def pad_to_multiple_of(self) -> int:
        """What every microbatch's rows are padded up to a multiple of (the limits' config)."""
        return self.limits.config.pad_to_multiple_of

    def accumulate(
        self,
        examples: Sequence[Tensor],
        *,
        tier: Tier | None = None,
        pad_value: int = 0,
        precision: Precision | None = None,
    ) -> AccumulatedLoss:
        """The batch's gradient, from cleared gradients, with ``accumulate_gradients``."""
        return self.run(
            [len(example) for example in examples],
            lambda plan: accumulate_gradients(
                self.model, examples, plan, tier=tier, pad_value=pad_value, precision=precision,
                pad_to_multiple_of=self.pad_to_multiple_of,
            ),
        )

    def run(self, lengths: Sequence[int], attempt: Attempt[Result]) -> Result:
        """``attempt(microbatches)`` with gradients cleared first, retried after OOM.

        ``lengths`` are the batch's sequence lengths; ``attempt`` receives the planned index
        lists and does the forward/backward passes (several tiers, say).
        """
        if not lengths:
            raise BatchError("a batch needs at least one example; got none.")
        longest = max(lengths)
        self.model.zero_grad(set_to_none=True)
        while True:
            limits = self.limits.limits(longest)
            plan = split_microbatches(
                lengths, max_tokens=limits.max_tokens, max_examples=limits.max_examples,
                pad_to_multiple_of=self.pad_to_multiple_of,
            )
            try:
                result = attempt(plan)
            except torch.OutOfMemoryError as error:
                # Its traceback's frames hold the failed attempt's activations; drop them.
                oom = error.with_traceback(None)
            else:
                self.limits.succeeded(longest)
                return result
            self.model.zero_grad(set_to_none=True)
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()
            try:
                self.limits.shrink(
                    longest,
                    rows=max(len(indices) for indices in plan),
                    tokens=max(padded_tokens([lengths[i] for i in mb], self.pad_to_multiple_of)
                               for mb in plan),
                )
            except BatchDoesNotFit as error:
                raise error from oom
