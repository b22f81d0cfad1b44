"""Training sequences rebuilt from pretokenized chunks, for any multiple of ``chunk_size``.

With ``max_seq_len = k × chunk_size``, a document of ``c`` chunks gives ``ceil(c / k)``
sequences: chunks ``0..k-1``, ``k..2k-1``, ... (the last may hold fewer). Sequences never
cross documents, so nothing is retokenized when ``max_seq_len`` changes.

Sequence ids: submdats in catalogue id order, within each the view's documents in index
order, within each document its sequences in order; ids count up from 0 across all of it.
The index is built from the per-document chunk counts alone (no token is read), so
``len(reader)`` is known at once and ``reader[i]`` is two binary searches and one slice.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from modeling.errors import SequenceLengthError
from modeling.mdat.pretok_files import PretokArrays
from modeling.mdat.strategy import Strategy


def chunks_per_sequence(strategy: Strategy, max_seq_len: int) -> int:
    """``k`` such that ``max_seq_len = k × chunk_size``."""
    k, rest = divmod(max_seq_len, strategy.chunk_size)
    if rest or k < 1 or isinstance(max_seq_len, bool):
        raise SequenceLengthError(
            f"max_seq_len {max_seq_len} is not a positive multiple of strategy "
            f"{strategy.name!r}'s chunk_size {strategy.chunk_size}; use one of "
            f"{[strategy.chunk_size * n for n in (1, 2, 4, 8)]}, ... or pretokenize with "
            "another chunk_size."
        )
    return k


@dataclass(frozen=True, slots=True)
class SequenceLocation:
    """Where a sequence comes from."""

    submdat: str
    document: int
    first_chunk: int  # index of its first chunk within the document
    chunks: int
    ends_document: bool  # True for a document's last sequence


class _Part:
    """The sequences of one submdat's selected documents."""

    def __init__(self, submdat: str, arrays: PretokArrays, documents: np.ndarray, k: int) -> None:
        self.submdat = submdat
        self.tokens = np.asarray(arrays.tokens)  # plain ndarray view: faster slicing than memmap
        self.chunk_start = np.concatenate([[0], np.cumsum(arrays.chunks, dtype=np.int64)])
        self.doc_first_chunk = np.concatenate([[0], np.cumsum(arrays.doc_chunks, dtype=np.int64)])
        self.documents = documents  # (selected,) sorted document indices
        per_document = (arrays.doc_chunks[documents].astype(np.int64) + k - 1) // k
        self.sequence_start = np.concatenate([[0], np.cumsum(per_document)])  # (selected + 1,)

    def __len__(self) -> int:
        return int(self.sequence_start[-1])

    def chunk_range(self, local: int, k: int) -> tuple[int, int, int, int]:
        """(document, first chunk, end chunk, document's end chunk) of local sequence ``local``."""
        j = int(np.searchsorted(self.sequence_start, local, side="right")) - 1
        document = int(self.documents[j])
        first = int(self.doc_first_chunk[document]) + (local - int(self.sequence_start[j])) * k
        doc_end = int(self.doc_first_chunk[document + 1])
        return document, first, min(first + k, doc_end), doc_end


class SequenceReader:
    """Random access to the sequences of a view: ``reader[i]`` is a 1-D token array."""

    def __init__(self, parts: list[tuple[str, PretokArrays, np.ndarray]], strategy: Strategy,
                 max_seq_len: int) -> None:
        self.strategy = strategy
        self.max_seq_len = max_seq_len
        self._k = chunks_per_sequence(strategy, max_seq_len)
        self._parts = [_Part(name, arrays, docs, self._k) for name, arrays, docs in parts]
        self._part_start = np.cumsum([0] + [len(part) for part in self._parts]).tolist()

    def __len__(self) -> int:
        return self._part_start[-1]

    def _find(self, index: int) -> tuple[_Part, tuple[int, int, int, int]]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sequence {index} outside 0..{len(self) - 1}")
        index %= len(self)
        p = bisect.bisect_right(self._part_start, index) - 1
        part = self._parts[p]
        return part, part.chunk_range(index - self._part_start[p], self._k)

    def __getitem__(self, index: int) -> np.ndarray:
        part, (_, first, end, _) = self._find(index)
        return part.tokens[part.chunk_start[first]:part.chunk_start[end]]  # (<= max_seq_len,)

    def locate(self, index: int) -> SequenceLocation:
        part, (document, first, end, doc_end) = self._find(index)
        doc_first = int(part.doc_first_chunk[document])
        return SequenceLocation(part.submdat, document, first - doc_first, end - first,
                                end == doc_end)

    def __iter__(self) -> Iterator[np.ndarray]:
        for index in range(len(self)):
            yield self[index]
