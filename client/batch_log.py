"""What a standalone run says about its batches besides the losses: the longest sequences of
a step every ``--log-longest-every`` steps, and with ``--debug`` the microbatches each step
ran in (rows and padded tokens of each, and how many plans out-of-memory errors cost).

The plan is the runner's own, recorded as it runs: a ``MicrobatchRunner`` that notes each
plan it hands to the step. Under data parallelism rank 0 prints its share's plan; under
``--fsdp`` the ranks run a fixed plan in lockstep, outside the runner, and none is printed.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from matformer.modeling.batching import AdaptiveLimits, MicrobatchRunner, padded_tokens
from matformer.modeling.batching.runner import Attempt, Result
from matformer.modeling.models import AutoregressiveModel

SHOWN = 3  # longest sequences named per line


def longest_line(done: int, total: int, lengths: np.ndarray) -> str:
    """The ``done``-th step's longest sequences (``lengths``: its sequences' token counts)."""
    top = sorted(lengths.tolist(), reverse=True)[:SHOWN]
    return (f"step {done}/{total}: longest sequences {', '.join(map(str, top))} tokens "
            f"(of {len(lengths)} sequences, {int(lengths.sum()):,} tokens)")


class PlanRecorder(MicrobatchRunner):
    """A runner that keeps the last plan it ran, as (rows, padded tokens) per microbatch,
    and counts the plans that ran out of memory before it."""

    def __init__(self, model: AutoregressiveModel, limits: AdaptiveLimits) -> None:
        super().__init__(model, limits)
        self.plan: list[tuple[int, int]] = []
        self.out_of_memory = 0

    def run(self, lengths: Sequence[int], attempt: Attempt[Result]) -> Result:
        def recorded(plan: list[list[int]]) -> Result:
            self.plan = [(len(rows), padded_tokens([lengths[i] for i in rows],
                                                   self.pad_to_multiple_of)) for rows in plan]
            try:
                return attempt(plan)
            except torch.OutOfMemoryError:
                self.out_of_memory += 1
                raise

        return super().run(lengths, recorded)

    def plan_line(self, done: int, total: int) -> str:
        """The plan the ``done``-th step ran; then forgets it, for the next step."""
        plan, retries, self.plan, self.out_of_memory = self.plan, self.out_of_memory, [], 0
        if not plan:
            return f"step {done}/{total}: no microbatches (no rows for this rank)"
        shown = " ".join(f"[{rows}, {tokens}]" for rows, tokens in plan)
        retried = f" after {retries} out of memory" if retries else ""
        return (f"step {done}/{total}: {len(plan)} microbatches{retried}, [rows, padded "
                f"tokens] each: {shown}")
