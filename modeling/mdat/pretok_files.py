"""Pretokenized output on disk: ``pretok/<strategy>/<submdat>/``.

- ``tokens.npy``: every document's tokens, one after another (uint16, or uint32 for vocabularies
  above 65,536 ids).
- ``chunks.npy``: every chunk's length in tokens (uint32), in document order.
- ``doc_chunks.npy``: how many chunks each document has (uint32).
- ``histogram.npy``: ``histogram[c]`` = documents with ``c`` chunks, written on completion.

Flat ``.npy`` files rather than LMDB: a sequence is a contiguous slice of ``tokens.npy``,
read straight from a memory map with no per-chunk lookups. The first three grow batch by batch
(`AppendableNpy`); the catalogue's pretok row records how much of each is committed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from modeling.mdat.catalogue import PretokProgress
from modeling.mdat.npy_files import AppendableNpy, load_npy, save_npy

TOKENS = "tokens.npy"
CHUNKS = "chunks.npy"
DOC_CHUNKS = "doc_chunks.npy"
HISTOGRAM = "histogram.npy"
TOKENIZER_FILE = "tokenizer.json"  # the strategy's copy of a "huggingface" tokenizer


def strategy_folder(root: Path, strategy: str) -> Path:
    return root / "pretok" / strategy


def pretok_folder(root: Path, strategy: str, submdat: str) -> Path:
    return strategy_folder(root, strategy) / submdat


@dataclass(frozen=True, slots=True)
class PretokArrays:
    """The committed arrays of one complete (strategy, submdat), memory-mapped."""

    tokens: np.ndarray  # (tokens,)
    chunks: np.ndarray  # (chunks,) lengths
    doc_chunks: np.ndarray  # (documents,) chunk counts
    histogram: np.ndarray  # (max chunks per document + 1,)

    @classmethod
    def load(cls, folder: Path, progress: PretokProgress) -> PretokArrays:
        fix = f"run pretokenize with strategy {progress.strategy!r} again: it rebuilds it"
        return cls(
            load_npy(folder / TOKENS, progress.tokens, fix=fix),
            load_npy(folder / CHUNKS, progress.chunks, fix=fix),
            load_npy(folder / DOC_CHUNKS, progress.documents, fix=fix),
            load_npy(folder / HISTOGRAM, fix=fix),
        )


class PretokWriter:
    """Appends batches of (tokens, chunk lengths, chunk counts) after the committed ones."""

    def __init__(self, folder: Path, token_dtype: np.dtype, progress: PretokProgress) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self._tokens = AppendableNpy(folder / TOKENS, token_dtype, progress.tokens)
        self._chunks = AppendableNpy(folder / CHUNKS, np.uint32, progress.chunks)
        self._doc_chunks = AppendableNpy(folder / DOC_CHUNKS, np.uint32, progress.documents)

    def write(self, tokens: np.ndarray, chunks: np.ndarray, doc_chunks: np.ndarray) -> None:
        for file, values in ((self._tokens, tokens), (self._chunks, chunks),
                             (self._doc_chunks, doc_chunks)):
            file.append(values)
            file.commit()

    def progress(self, strategy: str, submdat_id: int) -> PretokProgress:
        return PretokProgress(strategy, submdat_id, False, self._doc_chunks.length,
                              self._tokens.length, self._chunks.length)

    def finish(self) -> None:
        """Write the histogram of chunks per document; the submdat is then complete."""
        self.close()
        doc_chunks = load_npy(self.folder / DOC_CHUNKS, self._doc_chunks.length)
        save_npy(self.folder / HISTOGRAM, np.bincount(doc_chunks, minlength=1).astype(np.uint64))

    def close(self) -> None:
        for file in (self._tokens, self._chunks, self._doc_chunks):
            file.close()
