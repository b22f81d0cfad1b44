"""What a batch costs: its padded size, rows × longest row.

Every budget in this package counts padded tokens, because that is what a padded batch
allocates and computes on. Counting real tokens instead would let one long sequence and
many short ones pass a budget while their padded batch is many times larger.
"""

from __future__ import annotations

from collections.abc import Sequence

from matformer.modeling.batch import padded_size
from matformer.modeling.errors import BatchError, ConfigError, SequenceTooLong


def padded_tokens(lengths: Sequence[int], multiple: int = 1) -> int:
    """Tokens a batch of sequences of ``lengths`` holds once padded: rows × longest, the
    longest rounded up to a ``multiple`` (``pad_to_multiple_of``: 8 or 64 suit tensor cores)."""
    return len(lengths) * padded_size(max(lengths, default=0), multiple)


def checked_lengths(lengths: Sequence[int], max_tokens: int, budget: str, multiple: int = 1
                    ) -> list[int]:
    """``lengths`` as ints, after checking each is ≥ 1 and fits ``max_tokens`` on its own,
    padded up to ``multiple``; the sizes a budget counts are those padded ones.

    ``budget`` names the limit in the error message, so it tells the user what to raise.
    """
    if max_tokens < 1:
        raise ConfigError(f"{budget} must be at least 1 token, got {max_tokens}.")
    sizes = [int(n) for n in lengths]
    for index, size in enumerate(sizes):
        if size < 1:
            raise BatchError(f"sequence {index} has length {size}; drop empty sequences first.")
        padded = padded_size(size, multiple)
        if padded > max_tokens:
            held = f" ({size} padded to a multiple of {multiple})" if padded > size else ""
            raise SequenceTooLong(
                f"sequence {index} has {padded} tokens{held} but {budget}={max_tokens}; raise "
                f"{budget} to at least {padded}, or truncate or split sequences to fit it."
            )
    return sizes
