"""Microbatches: split one batch into forward/backward passes that fit in memory.

Rows are sorted by length, longest first, and cut greedily: a microbatch takes the next
row while its rows stay ≤ ``max_examples`` and its padded size (rows × its first, longest
row) stays ≤ ``max_tokens``. On sorted rows this greedy cut gives the fewest microbatches,
and rows of similar length share a microbatch, so little padding is added. The largest
rows run first, so a pass that does not fit in memory fails before the others have run.

A batch planned by ``plan_batches`` with budget B, split with any ``max_tokens``, pads to
at most B tokens in all: each microbatch's longest row is at most the batch's longest.
"""

from __future__ import annotations

from collections.abc import Sequence

from matformer.modeling.batch import padded_size
from matformer.modeling.batching.cost import checked_lengths
from matformer.modeling.errors import ConfigError


def split_microbatches(
    lengths: Sequence[int], *, max_tokens: int, max_examples: int, pad_to_multiple_of: int = 1
) -> list[list[int]]:
    """Positions into ``lengths`` of each microbatch, longest rows first.

    Every position appears exactly once; each microbatch has ≤ ``max_examples`` rows and
    rows × longest (padded up to ``pad_to_multiple_of``) ≤ ``max_tokens``. Raises
    SequenceTooLong if a row alone exceeds ``max_tokens``.
    """
    sizes = checked_lengths(lengths, max_tokens, "max_tokens", pad_to_multiple_of)
    if max_examples < 1:
        raise ConfigError(f"max_examples must be at least 1, got {max_examples}.")
    microbatches: list[list[int]] = []
    for index in sorted(range(len(sizes)), key=lambda i: sizes[i], reverse=True):
        if microbatches:
            current = microbatches[-1]
            rows = len(current) + 1
            # Sorted longest first, so a microbatch's first row is its longest.
            longest = padded_size(sizes[current[0]], pad_to_multiple_of)
            if rows <= max_examples and rows * longest <= max_tokens:
                current.append(index)
                continue
        microbatches.append([index])
    return microbatches
