"""Splitting batches of documents, in this process or in a pool of worker processes.

This process reads the documents from LMDB and sends them to the workers, which only run the
splitter: LMDB environments cannot be shared with forked children, and forking (rather than
spawning) starts workers at once and needs no ``if __name__ == "__main__"`` guard in the
user's script. At most ``2 × processes`` batches are in flight, so memory stays bounded, and
results come back in batch order, so the output is the same for any number of processes.
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.pool import AsyncResult
from pathlib import Path
from typing import Any

import numpy as np

from matformer.modeling.mdat.catalogue import SubmdatInfo
from matformer.modeling.mdat.document_splitter import DocumentSplitter
from matformer.modeling.mdat.pretok_files import TOKENIZER_FILE, strategy_folder
from matformer.modeling.mdat.strategy import Strategy
from matformer.modeling.mdat.submdat import Submdat


@dataclass(frozen=True, slots=True)
class Batch:
    submdat: SubmdatInfo
    indices: list[int]  # each document's index in the submdat
    documents: list[dict[str, Any]]  # the wants_from_db fields of each document


@dataclass(frozen=True, slots=True)
class BatchResult:
    tokens: np.ndarray  # (tokens,) every document's tokens, concatenated
    chunks: np.ndarray  # (chunks,) chunk lengths
    doc_chunks: np.ndarray  # (documents,) chunks per document
    loss_mask: np.ndarray | None = None  # (tokens,) uint8, instruction data only


def read_batches(root: Path, strategy: Strategy, submdat: SubmdatInfo, start: int,
                 batch_size: int, chosen: np.ndarray | None = None) -> Iterator[Batch]:
    """The documents of ``submdat`` (``chosen``: only these sorted indices), from the
    ``start``-th on, ``batch_size`` at a time, as the splitter wants them."""
    reader = Submdat(root / "datasets" / submdat.name, submdat)
    total = submdat.documents if chosen is None else len(chosen)
    try:
        for first in range(start, total, batch_size):
            stop = min(first + batch_size, total)
            if chosen is None:  # one cursor over a run of documents
                indices, raws = list(range(first, stop)), reader.raw_range(first, stop)
            else:
                indices = chosen[first:stop].tolist()
                raws = (reader.raw(index) for index in indices)
            documents = []
            for index, raw in zip(indices, raws, strict=True):
                document: dict[str, Any] = {}
                if "data" in strategy.wants_from_db:
                    document["data"] = raw.decode("utf-8") if strategy.wants_raw else raw
                if "meta" in strategy.wants_from_db:
                    document["meta"] = reader.metadata(index)
                documents.append(document)
            yield Batch(submdat, indices, documents)
    finally:
        reader.close()


def build_splitter(root: Path, strategy: Strategy,
                   trust_remote_code: bool = False) -> DocumentSplitter:
    tokenizer = strategy_folder(root, strategy.name) / TOKENIZER_FILE
    return DocumentSplitter(strategy, root / "functions",
                            tokenizer if strategy.tokenizer_name else None,
                            trust_remote_code=trust_remote_code)


def split_batch(splitter: DocumentSplitter, batch: Batch) -> BatchResult:
    tokens, chunks, masks = [], [], []
    for index, document in zip(batch.indices, batch.documents, strict=True):
        where = f"document {index} of submdat {batch.submdat.name!r}"
        doc_tokens, doc_chunks, doc_mask = splitter.split(document, where)
        tokens.append(doc_tokens)
        chunks.append(doc_chunks)
        masks.append(doc_mask)
    return BatchResult(
        np.concatenate(tokens).astype(splitter.strategy.token_dtype),
        np.concatenate(chunks).astype(np.uint32),
        np.array([len(c) for c in chunks], dtype=np.uint32),
        np.concatenate(masks) if splitter.strategy.loss_masked else None,
    )


_splitter: DocumentSplitter | None = None  # a worker process's splitter, from _init_worker


def _init_worker(root: Path, strategy: Strategy, trust_remote_code: bool) -> None:
    global _splitter
    _splitter = build_splitter(root, strategy, trust_remote_code)


def _split_in_worker(batch: Batch) -> BatchResult:
    assert _splitter is not None, "_init_worker runs first in every worker process"
    return split_batch(_splitter, batch)


def split_batches(root: Path, strategy: Strategy, batches: Iterable[Batch], processes: int,
                  trust_remote_code: bool = False) -> Iterator[tuple[Batch, BatchResult]]:
    """Each batch with its result, in order, from ``processes`` processes."""
    if processes <= 1:
        splitter = build_splitter(root, strategy, trust_remote_code)
        for batch in batches:
            yield batch, split_batch(splitter, batch)
        return
    # a strategy error surfaces here, not in every worker
    build_splitter(root, strategy, trust_remote_code)
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    with context.Pool(processes, initializer=_init_worker,
                      initargs=(root, strategy, trust_remote_code)) as pool:
        pending: deque[tuple[Batch, AsyncResult]] = deque()
        for batch in batches:
            pending.append((batch, pool.apply_async(_split_in_worker, (batch,))))
            if len(pending) >= 2 * processes:
                done, result = pending.popleft()
                yield done, result.get()
        while pending:
            done, result = pending.popleft()
            yield done, result.get()
