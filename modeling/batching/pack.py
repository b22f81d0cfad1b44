"""Packed batches: sequences laid end to end in rows, so a batch carries almost no padding.

A padded batch costs rows × longest sequence; a packed one costs rows × ``row_length``, and
its rows are filled with whole sequences (none is split or truncated; attention and the loss
keep documents apart, see modeling/batch.py). How full the rows are is a bin-packing
problem, solved here by first fit decreasing: longest sequence first, each into the first
row with room. Short sequences come last and fill the gaps the long ones left, which is
why the rows come out nearly full on mixed lengths.

``plan_packed`` packs windows of consecutive sequences, ``sort_window`` batches' worth of
tokens each, as ``plan_batches`` sorts them: data order holds between windows. A window's
rows are cut into batches of ``max_tokens // row_length`` rows; only the window's last row
and its last batch may be short. A window's last row, when less than half full, opens the
next window's rows instead: its room is filled there rather than padded, and as the first
row the next window fills, no sequence waits more than one window for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from matformer.modeling.batching.cost import checked_lengths
from matformer.modeling.batching.plan import window_runs
from matformer.modeling.errors import ConfigError

Rows = list[list[int]]  # each row: indices of the sequences laid end to end in it


def pack_rows(lengths: Sequence[int], row_length: int) -> Rows:
    """First fit decreasing: indices into ``lengths`` per row, each row's lengths summing to
    at most ``row_length``. Raises SequenceTooLong if a sequence alone exceeds it."""
    sizes = checked_lengths(lengths, row_length, "row_length")
    return _first_fit_decreasing(range(len(sizes)), sizes, row_length)


def _first_fit_decreasing(indices: Sequence[int], sizes: Sequence[int], row_length: int,
                          opened: Sequence[int] = ()) -> Rows:
    """Rows of ``indices``; ``opened``, if given, is a row already begun, filled first."""
    rows: Rows = [list(opened)] if opened else []
    room: list[int] = [row_length - sum(sizes[i] for i in opened)] if opened else []
    for index in sorted(indices, key=lambda i: sizes[i], reverse=True):  # stable on ties
        size = sizes[index]
        row = next((r for r, left in enumerate(room) if left >= size), len(rows))
        if row == len(rows):
            rows.append([])
            room.append(row_length)
        rows[row].append(index)
        room[row] -= size
    return rows


def plan_packed(
    lengths: Sequence[int], max_tokens: int, row_length: int, *, sort_window: int = 16
) -> list[Rows]:
    """Batches of packed rows: each batch's rows × ``row_length`` ≤ ``max_tokens``, every
    sequence in exactly one row. ``row_length`` is capped at ``max_tokens`` (a row is the
    smallest unit of a batch); ``sort_window`` ≥ 1 is how many batches' worth of tokens are
    packed together. Raises SequenceTooLong if a sequence exceeds the row length."""
    row_length = min(row_length, max_tokens)
    sizes = checked_lengths(lengths, row_length, "row_length (the longest sequence allowed)")
    if sort_window < 1:
        raise ConfigError(f"sort_window of packed batches must be at least 1, got {sort_window}.")
    per_batch = max_tokens // row_length
    batches: list[Rows] = []
    carried: list[int] = []
    runs = list(window_runs(sizes, sort_window * max_tokens))
    for number, run in enumerate(runs):
        rows = _first_fit_decreasing(run, sizes, row_length, opened=carried)
        carried = []
        last = number == len(runs) - 1
        if not last and sum(sizes[i] for i in rows[-1]) * 2 < row_length:
            carried = rows.pop()
        batches.extend(rows[start:start + per_batch] for start in range(0, len(rows), per_batch))
    return batches
