"""Training sequences rebuilt from pretokenized chunks, for any multiple of ``chunk_size``.

With ``max_seq_len = k × chunk_size``, a document of ``c`` chunks gives ``ceil(c / k)``
sequences: chunks ``0..k-1``, ``k..2k-1``, ... (the last may hold fewer). Sequences never
cross documents, so nothing is retokenized when ``max_seq_len`` changes.

Sequence ids: submdats in catalogue id order, within each the view's documents in index
order, within each document its sequences in order; ids count up from 0 across all of it.
``len(reader)`` reads no offsets: it comes from the stored histograms of chunks per document
(every document of a submdat) or from the selected documents' chunk counts (a view). The
first ``reader[i]`` of a submdat builds its index of first sequence ids, one int64 per
selected document; then each read is two binary searches and one slice of memory maps.
``reader.lengths()`` gives every sequence's length at once from the same offsets. A view
pretokenized on its own reads arrays holding only its documents (`ReaderPart.numbers` maps
them back to the submdat's), and gives the same ids and tokens as one read from the whole
submdat's arrays.

Sequences hold the document's tokens only, no special tokens: a consumer that wants an end
of document marker appends ``reader.strategy.eos_token_id`` where
``reader.locate(i).ends_document`` (and ``bos_token_id`` where ``first_chunk == 0``).
Instruction data is the exception: its chat template puts in the markers it wants. Its
sequences carry prompt marks (`modeling.prompt_marks`), read from the stored loss mask: a
prompt token ``t`` is ``~t`` in ``reader[i]``, whose dtype is then signed (``token_dtype``).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from matformer.modeling.errors import SequenceLengthError
from matformer.modeling.mdat.pretok_files import PretokArrays
from matformer.modeling.mdat.strategy import Strategy
from matformer.modeling.prompt_marks import mark_prompt, marked_dtype


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


@dataclass(frozen=True, slots=True)
class ReaderPart:
    """One submdat's share of a reader: pretokenized arrays, which of their documents it
    reads, and what the submdat numbers the documents the arrays hold."""

    submdat: str
    arrays: PretokArrays
    documents: np.ndarray | None = None  # (selected,) sorted positions in the arrays; None: all
    numbers: np.ndarray | None = None  # (held,) each held document's index; None: its position


class _Part:
    """The sequences of one submdat's selected documents."""

    def __init__(self, source: ReaderPart, k: int) -> None:
        arrays = source.arrays
        self.submdat = source.submdat
        self.tokens = np.asarray(arrays.tokens)  # plain ndarray view: faster slicing than memmap
        self.chunk_starts = np.asarray(arrays.chunk_starts)  # (chunks + 1,)
        self.doc_starts = np.asarray(arrays.doc_starts)  # (documents + 1,)
        # (tokens,) 1 on response tokens; None: not instruction data
        self.loss_mask = None if arrays.loss_mask is None else np.asarray(arrays.loss_mask)
        self.documents = source.documents  # (selected,) sorted positions; None: all of them
        self.numbers = source.numbers  # (held,) the submdat's index of each; None: the same
        self.k = k
        if self.documents is None:
            counts = np.flatnonzero(arrays.histogram)  # chunks per document that occur
            self.length = int(arrays.histogram[counts].astype(np.int64) @ ((counts + k - 1) // k))
        else:
            self.length = int(self._sequences_per_document().sum())

    def _sequences_per_document(self) -> np.ndarray:
        """(selected,) ``ceil(chunks / k)`` of each selected document."""
        starts = self.doc_starts
        if self.documents is None:
            chunks = np.diff(starts)
        else:
            chunks = starts[self.documents + 1] - starts[self.documents]
        return (chunks + self.k - 1) // self.k

    @cached_property
    def sequence_start(self) -> np.ndarray:
        """(selected + 1,) the local id of each selected document's first sequence."""
        return np.concatenate([[0], np.cumsum(self._sequences_per_document())])

    def lengths(self) -> np.ndarray:
        """(sequences,) int64 tokens of each local sequence, in id order."""
        first, end = self._token_ranges()
        return end - first

    def response_lengths(self) -> np.ndarray:
        """(sequences,) int64 response tokens of each local sequence after its first (the
        targets a causal model finds in it); the part must have a loss mask."""
        first, end = self._token_ranges()
        responses = np.concatenate([[0], np.cumsum(self.loss_mask, dtype=np.int64)])
        return responses[end] - responses[np.minimum(first + 1, end)]

    def _token_ranges(self) -> tuple[np.ndarray, np.ndarray]:
        """(sequences,) the first and the end token index of each local sequence."""
        counts = self._sequences_per_document()  # (selected,)
        chosen = slice(None) if self.documents is None else self.documents
        doc_first, doc_end = self.doc_starts[:-1][chosen], self.doc_starts[1:][chosen]
        # The document's sequence j (local id) starts at chunk doc_first + (j - its first id) k.
        shift = np.repeat(doc_first - self.sequence_start[:-1] * self.k, counts)
        first = np.arange(len(shift), dtype=np.int64) * self.k + shift  # (sequences,)
        end = np.minimum(first + self.k, np.repeat(doc_end, counts))
        return self.chunk_starts[first], self.chunk_starts[end]

    def chunk_range(self, local: int) -> tuple[int, int, int, int]:
        """(document, first chunk, end chunk, document's end chunk) of local sequence ``local``."""
        j = int(np.searchsorted(self.sequence_start, local, side="right")) - 1
        document = j if self.documents is None else int(self.documents[j])
        first = int(self.doc_starts[document]) + (local - int(self.sequence_start[j])) * self.k
        doc_end = int(self.doc_starts[document + 1])
        return document, first, min(first + self.k, doc_end), doc_end


class SequenceReader:
    """Random access to the sequences of a view: ``reader[i]`` is a 1-D token array.

    ``view`` and ``fingerprint`` (`Mdat.fingerprint`) say which data the ids refer to.
    """

    def __init__(self, parts: list[ReaderPart], strategy: Strategy, max_seq_len: int, *,
                 view: str, fingerprint: str) -> None:
        self.strategy = strategy
        self.max_seq_len = max_seq_len
        self.view = view
        self.fingerprint = fingerprint
        k = chunks_per_sequence(strategy, max_seq_len)
        self._parts = [_Part(part, k) for part in parts]
        self._part_start = np.cumsum([0] + [part.length for part in self._parts]).tolist()

    def __len__(self) -> int:
        return self._part_start[-1]

    def _find(self, index: int) -> tuple[_Part, tuple[int, int, int, int]]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sequence {index} outside 0..{len(self) - 1}")
        index %= len(self)
        p = bisect.bisect_right(self._part_start, index) - 1
        part = self._parts[p]
        return part, part.chunk_range(index - self._part_start[p])

    @property
    def token_dtype(self) -> np.dtype:
        """The dtype of ``reader[i]``: the strategy's, or a signed one that holds prompt
        marks (instruction data)."""
        dtype = self.strategy.token_dtype
        return marked_dtype(dtype) if self.strategy.loss_masked else dtype

    def __getitem__(self, index: int) -> np.ndarray:
        part, (_, first, end, _) = self._find(index)
        start, stop = part.chunk_starts[first], part.chunk_starts[end]
        if part.loss_mask is None:
            return part.tokens[start:stop]  # (<= max_seq_len,)
        return mark_prompt(part.tokens[start:stop], part.loss_mask[start:stop])

    def response_lengths(self) -> np.ndarray | None:
        """(len(self),) int64: the response tokens of each sequence after its first, which
        is what a causal model's loss falls on (a masked model's may also fall on the first);
        None when the sequences are not instruction data (every token a target)."""
        if not self.strategy.loss_masked:
            return None
        return np.concatenate([np.zeros(0, np.int64),
                               *(part.response_lengths() for part in self._parts)])

    def lengths(self) -> np.ndarray:
        """(len(self),) int64: ``len(self[i])`` for every id ``i``, computed from the offsets
        alone (no tokens are read)."""
        return np.concatenate([np.zeros(0, np.int64), *(part.lengths() for part in self._parts)])

    def locate(self, index: int) -> SequenceLocation:
        part, (document, first, end, doc_end) = self._find(index)
        doc_first = int(part.doc_starts[document])
        number = document if part.numbers is None else int(part.numbers[document])
        return SequenceLocation(part.submdat, number, first - doc_first, end - first,
                                end == doc_end)

    def __iter__(self) -> Iterator[np.ndarray]:
        for index in range(len(self)):
            yield self[index]
