"""Pretokenizing submdats with a strategy, resumable per submdat.

What one run pretokenizes is a list of targets (`PretokTarget`): every document of a
submdat, into ``pretok/``, or the documents a view chooses of it, into the view's own folder
(`pretok_files`). Documents go through the splitter in batches (`pretok_workers`). After each
batch the files are committed, then the target's pretok row in the catalogue. A run skips
complete targets, continues a partial one after its last committed batch (bytes written past
it are cut off), and rebuilds one whose files turn out shorter than the catalogue records.
Only the target whose batches are arriving has its files open, so any number of submdats
needs a handful of descriptors.
"""

from __future__ import annotations

import logging
import shutil
import sys
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from matformer.modeling.errors import MdatCorrupt
from matformer.modeling.mdat.catalogue import Catalogue, PretokProgress, SubmdatInfo
from matformer.modeling.mdat.pretok_files import PretokArrays, PretokWriter
from matformer.modeling.mdat.pretok_workers import read_batches, split_batches
from matformer.modeling.mdat.strategy import Strategy

log = logging.getLogger("matformer.mdat")


@dataclass(frozen=True, slots=True)
class PretokTarget:
    """One submdat's documents to pretokenize: all of them (``view`` None), or the ones a view
    chooses, into that view's own files, whose progress the catalogue keeps apart."""

    submdat: SubmdatInfo
    folder: Path  # where its files go
    view: str | None = None
    documents: np.ndarray | None = None  # (chosen,) sorted indices of the view's documents

    @property
    def count(self) -> int:
        return self.submdat.documents if self.documents is None else len(self.documents)


def _committed(catalogue: Catalogue, strategy: Strategy, target: PretokTarget) -> PretokProgress:
    """The progress to continue from, after checking its files; damaged ones start over."""
    progress = catalogue.pretok(strategy.name, target.submdat.id, target.view)
    try:
        if progress.complete:
            PretokArrays.load(target.folder, progress, strategy.vocab_size,
                              masked=strategy.loss_masked)
        else:
            PretokWriter(target.folder, strategy.token_dtype, progress,
                         masked=strategy.loss_masked).close()
    except MdatCorrupt as err:
        log.warning("matformer.mdat: rebuilding %s: %s", target.folder, err)
        shutil.rmtree(target.folder, ignore_errors=True)
        progress = PretokProgress(strategy.name, target.submdat.id)
        catalogue.save_pretok(progress, target.view)
    return progress


def pretokenize(
    root: Path,
    catalogue: Catalogue,
    strategy: Strategy,
    targets: list[PretokTarget],
    *,
    processes: int,
    batch_size: int,
    progress: bool,
    trust_remote_code: bool = False,
) -> None:
    """Pretokenize every target (of distinct complete submdats) not done yet; the
    container's ``functions/`` run only with ``trust_remote_code``."""
    committed = {t.submdat.id: _committed(catalogue, strategy, t) for t in targets}
    todo = [target for target in targets if not committed[target.submdat.id].complete]
    pending = deque(todo)  # targets not finished yet, in the order their batches come
    batches = (
        batch
        for target in todo
        for batch in read_batches(root, strategy, target.submdat,
                                  committed[target.submdat.id].documents, batch_size,
                                  target.documents)
    )
    bar = tqdm(total=sum(target.count for target in todo),
               initial=sum(committed[target.submdat.id].documents for target in todo),
               desc=f"pretokenize {strategy.name}", unit="doc", file=sys.stderr,
               disable=not progress)
    writer: PretokWriter | None = None  # of pending[0], once its first batch arrived

    def open_writer(target: PretokTarget) -> PretokWriter:
        return PretokWriter(target.folder, strategy.token_dtype, committed[target.submdat.id],
                            masked=strategy.loss_masked)

    def finish_first() -> None:
        """Complete ``pending[0]``, whose batches have all been written."""
        nonlocal writer
        target = pending.popleft()
        if writer is None:  # it had no batch left to write
            writer = open_writer(target)
        writer.finish()
        writer = None
        done = catalogue.pretok(strategy.name, target.submdat.id, target.view)
        catalogue.save_pretok(replace(done, complete=True), target.view)

    try:
        for batch, result in split_batches(root, strategy, batches, processes,
                                          trust_remote_code):
            while pending[0].submdat.id != batch.submdat.id:
                finish_first()
            if writer is None:
                writer = open_writer(pending[0])
            writer.write(result.tokens, result.chunks, result.doc_chunks, result.loss_mask)
            catalogue.save_pretok(writer.progress(strategy.name, batch.submdat.id),
                                  pending[0].view)
            bar.update(len(batch.documents))
        while pending:
            finish_first()
    finally:
        bar.close()
        if writer is not None:
            writer.close()
