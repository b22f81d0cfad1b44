"""Built-in splitters: registry entries of category ``"splitter"``.

A splitter is built as ``cls(tokenizer=..., chunk_size=..., **splitter_init)`` and called as
``splitter(document, **splitter_arguments)``, where ``document`` holds the strategy's
``wants_from_db`` fields (``"data"``: the text; ``"meta"``: the metadata dict). It returns a
dict with at least ``"tokens"`` (the document's token ids) and ``"chunks"`` (chunk lengths,
each in 1..chunk_size, summing to the number of tokens). Custom splitters follow the same
contract in a ``.py`` file of the container's ``functions/`` folder.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from matformer.modeling.mdat.sentence_ends import sentence_ends
from matformer.modeling.registry import registry
from matformer.modeling.tokenizers import TextTokenizer


def document_text(document: dict[str, Any]) -> str:
    data = document["data"]
    return data.decode("utf-8") if isinstance(data, bytes) else data


def fixed_lengths(total: int, chunk_size: int) -> np.ndarray:
    """Lengths of ``total`` tokens cut every ``chunk_size``: full chunks, then the rest."""
    full, rest = divmod(total, chunk_size)
    lengths = np.full(full + (rest > 0), chunk_size, dtype=np.int64)
    if rest:
        lengths[-1] = rest
    return lengths


def pack_sentences(sentence_lengths: list[int], chunk_size: int) -> np.ndarray:
    """Chunk lengths that pack whole sentences greedily; a longer sentence is cut."""
    chunks: list[int] = []
    current = 0
    for length in sentence_lengths:
        if current + length <= chunk_size:
            current += length
            continue
        if current:
            chunks.append(current)
        cut, current = divmod(length, chunk_size)
        chunks.extend([chunk_size] * cut)
    if current:
        chunks.append(current)
    return np.array(chunks, dtype=np.int64)


@registry.register("splitter", "fixed_chunks", "default")
class FixedChunks:
    """Cut the document's token stream into ``chunk_size`` pieces (the last may be shorter)."""

    def __init__(self, *, tokenizer: TextTokenizer, chunk_size: int) -> None:
        self.tokenizer = tokenizer
        self.chunk_size = chunk_size

    def __call__(self, document: dict[str, Any]) -> dict[str, Any]:
        tokens, _ = self.tokenizer.encode(document_text(document))
        return {"tokens": tokens, "chunks": fixed_lengths(len(tokens), self.chunk_size)}


@registry.register("splitter", "sentence_chunks", "default")
class SentenceChunks:
    """Chunks that end at sentence or paragraph ends, each holding whole sentences when they fit.

    ``language`` (``splitter_init``) finds sentences with NLTK's Punkt model of that language
    where it is installed, else (and by default) with a rule (`modeling.mdat.sentence_ends`).
    The document is tokenized once; a sentence's tokens are those starting at or after its
    first character, so the chunks' tokens, concatenated, are exactly the document's tokens.
    """

    def __init__(self, *, tokenizer: TextTokenizer, chunk_size: int,
                 language: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chunk_size = chunk_size
        self.sentence_ends = sentence_ends(language)

    def __call__(self, document: dict[str, Any]) -> dict[str, Any]:
        text = document_text(document)
        tokens, starts = self.tokenizer.encode(text)
        sentence_starts = np.unique(self.sentence_ends(text)).astype(np.int64)
        bounds = np.searchsorted(starts, sentence_starts, side="left")  # (sentences - 1,)
        edges = np.concatenate([[0], bounds, [len(tokens)]])
        lengths = np.diff(edges).tolist()
        return {"tokens": tokens, "chunks": pack_sentences(lengths, self.chunk_size)}


@registry.register("splitter", "split_and_tokenize_by_nltk_sentences_aligned", "default")
class SeedSentenceChunks(SentenceChunks):
    """Seed 000's name for `SentenceChunks`: its strategy JSON loads as written."""
