"""Pretokenized output on disk: ``pretok/<strategy>/<submdat>/`` for a whole submdat, and
``views/<view>/pretok/<strategy>/<submdat>/`` for a view pretokenized on its own, whose files
hold only the view's chosen documents of the submdat, in index order.

- ``tokens.npy``: every document's tokens, one after another (uint16, or uint32 for vocabularies
  above 65,536 ids).
- ``chunk_starts.npy``: (chunks + 1,) int64, the token index where each chunk starts, then the
  token count: chunk ``c`` is ``tokens[chunk_starts[c]:chunk_starts[c + 1]]``.
- ``doc_starts.npy``: (documents + 1,) int64, the chunk index where each document starts,
  then the chunk count: document ``d`` has ``doc_starts[d + 1] - doc_starts[d]`` chunks.
- ``histogram.npy``: ``histogram[c]`` = documents with ``c`` chunks, written on completion; it
  gives the number of sequences for any ``max_seq_len`` without reading the offsets.
- ``loss_mask.npy``: (tokens,) uint8, only for a strategy of instruction data
  (`Strategy.loss_masked`): 1 where a token is a response token, which the loss falls on, 0
  where it is prompt. Beside the tokens rather than in them, so ``tokens.npy`` reads the same
  whatever the strategy.

Flat ``.npy`` files rather than LMDB: a sequence is a contiguous slice of ``tokens.npy``,
read straight from a memory map with no per-chunk lookups, and the offsets are memory-mapped
too, so opening a reader costs no scan. The first three grow batch by batch (`AppendableNpy`);
the catalogue's pretok row records how much of each is committed.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from matformer.modeling.errors import MdatCorrupt
from matformer.modeling.mdat.catalogue import PretokProgress
from matformer.modeling.mdat.npy_files import AppendableNpy, load_npy, save_npy
from matformer.modeling.mdat.views import view_folder

TOKENS = "tokens.npy"
CHUNK_STARTS = "chunk_starts.npy"
DOC_STARTS = "doc_starts.npy"
HISTOGRAM = "histogram.npy"
LOSS_MASK = "loss_mask.npy"
TOKENIZER_FILE = "tokenizer.json"  # the strategy's copy of a "huggingface" tokenizer


def strategy_folder(root: Path, strategy: str) -> Path:
    return root / "pretok" / strategy


def pretok_folder(root: Path, strategy: str, submdat: str) -> Path:
    return strategy_folder(root, strategy) / submdat


def view_pretok_folder(root: Path, view: str, strategy: str, submdat: str) -> Path:
    return view_folder(root, view) / "pretok" / strategy / submdat


@dataclass(frozen=True, slots=True)
class PretokArrays:
    """The committed arrays of one complete (strategy, submdat), memory-mapped."""

    tokens: np.ndarray  # (tokens,)
    chunk_starts: np.ndarray  # (chunks + 1,)
    doc_starts: np.ndarray  # (documents + 1,)
    histogram: np.ndarray  # (max chunks per document + 1,)
    loss_mask: np.ndarray | None = None  # (tokens,) instruction data only

    @classmethod
    def load(cls, folder: Path, progress: PretokProgress, vocab_size: int | None = None, *,
             masked: bool = False) -> PretokArrays:
        """The arrays, checked against ``progress``; with ``vocab_size``, every token id too
        (one pass over the tokens: a damaged file is named here, not by a model's embedding
        lookup hours later). ``masked``: the strategy's loss mask is there too."""
        fix = f"run pretokenize with strategy {progress.strategy!r} again: it rebuilds it"
        arrays = cls(
            load_npy(folder / TOKENS, progress.tokens, fix=fix),
            load_npy(folder / CHUNK_STARTS, progress.chunks + 1, fix=fix),
            load_npy(folder / DOC_STARTS, progress.documents + 1, fix=fix),
            load_npy(folder / HISTOGRAM, fix=fix),
            load_npy(folder / LOSS_MASK, progress.tokens, fix=fix) if masked else None,
        )
        if arrays.histogram.sum() != progress.documents:
            raise MdatCorrupt(f"{folder / HISTOGRAM} does not count {progress.documents} "
                              f"documents; {fix}.")
        if vocab_size is not None and len(arrays.tokens):
            largest = arrays.tokens.max()
            if largest >= vocab_size:
                where = int(np.argmax(arrays.tokens >= vocab_size))
                raise MdatCorrupt(
                    f"{folder / TOKENS} holds token id {int(largest):,} (first at token "
                    f"{where:,}), outside the strategy's vocabulary 0..{vocab_size - 1:,}: the "
                    f"file is damaged; {fix}.")
        return arrays


class PretokWriter:
    """Appends batches of (tokens, chunk lengths, chunk counts, loss mask when ``masked``)
    after the committed ones.

    Opening one checks that the files hold the ``progress`` committed (`MdatCorrupt` if not)
    and cuts off whatever an interrupted run wrote past it.
    """

    def __init__(self, folder: Path, token_dtype: np.dtype, progress: PretokProgress, *,
                 masked: bool = False) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        started = progress.documents > 0  # else the offsets files are new, or hold nothing
        with ExitStack() as opened:  # what opened is closed again if a later file fails
            self._tokens = _opened(opened, folder / TOKENS, token_dtype, progress.tokens)
            self._chunk_starts = _opened(opened, folder / CHUNK_STARTS, np.int64,
                                         progress.chunks + 1 if started else 0)
            self._doc_starts = _opened(opened, folder / DOC_STARTS, np.int64,
                                       progress.documents + 1 if started else 0)
            self._loss_mask = _opened(opened, folder / LOSS_MASK, np.uint8,
                                      progress.tokens) if masked else None
            self._close = opened.pop_all().close
        if not started:  # the offsets files start with 0
            self._chunk_starts.append(np.zeros(1, dtype=np.int64))
            self._doc_starts.append(np.zeros(1, dtype=np.int64))

    def write(self, tokens: np.ndarray, chunks: np.ndarray, doc_chunks: np.ndarray,
              loss_mask: np.ndarray | None = None) -> None:
        """Commit a batch: its tokens (n,), chunk lengths (c,), chunks per document (d,) and,
        when the writer is ``masked``, loss mask (n,)."""
        chunk_ends = self._tokens.length + np.cumsum(chunks, dtype=np.int64)
        doc_ends = self._chunk_starts.length - 1 + np.cumsum(doc_chunks, dtype=np.int64)
        masks = [] if self._loss_mask is None else [(self._loss_mask, loss_mask)]
        for file, values in ((self._tokens, tokens), (self._chunk_starts, chunk_ends),
                             (self._doc_starts, doc_ends), *masks):
            file.append(values)
            file.commit()

    def progress(self, strategy: str, submdat_id: int) -> PretokProgress:
        return PretokProgress(strategy, submdat_id, False, self._doc_starts.length - 1,
                              self._tokens.length, self._chunk_starts.length - 1)

    def finish(self) -> None:
        """Write the histogram of chunks per document; the submdat is then complete."""
        self._doc_starts.commit()  # a submdat without documents has written no batch
        self._chunk_starts.commit()
        self.close()
        starts = load_npy(self.folder / DOC_STARTS, self._doc_starts.length)
        save_npy(self.folder / HISTOGRAM, np.bincount(np.diff(starts), minlength=1)
                 .astype(np.uint64))

    def close(self) -> None:
        self._close()


def _opened(opened: ExitStack, path: Path, dtype: np.dtype | type, length: int) -> AppendableNpy:
    file = AppendableNpy(path, dtype, length)
    opened.callback(file.close)
    return file
