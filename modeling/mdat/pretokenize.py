"""Pretokenizing submdats with a strategy, resumable per submdat.

Documents go through the splitter in batches (`pretok_workers`). After each batch the files
are committed, then the catalogue's pretok row. A run skips complete submdats, continues a
partial one after its last committed batch (bytes written past it are cut off), and rebuilds
one whose files turn out shorter than the catalogue records. Only the submdat whose batches
are arriving has its files open, so any number of submdats needs a handful of descriptors.
"""

from __future__ import annotations

import logging
import shutil
import sys
from collections import deque
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from matformer.modeling.errors import MdatCorrupt
from matformer.modeling.mdat.catalogue import Catalogue, PretokProgress, SubmdatInfo
from matformer.modeling.mdat.pretok_files import PretokArrays, PretokWriter, pretok_folder
from matformer.modeling.mdat.pretok_workers import read_batches, split_batches
from matformer.modeling.mdat.strategy import Strategy

log = logging.getLogger("matformer.mdat")


def _committed(root: Path, catalogue: Catalogue, strategy: Strategy,
               info: SubmdatInfo) -> PretokProgress:
    """The progress to continue from, after checking its files; damaged ones start over."""
    folder = pretok_folder(root, strategy.name, info.name)
    progress = catalogue.pretok(strategy.name, info.id)
    try:
        if progress.complete:
            PretokArrays.load(folder, progress, strategy.vocab_size)
        else:
            PretokWriter(folder, strategy.token_dtype, progress).close()
    except MdatCorrupt as err:
        log.warning("matformer.mdat: rebuilding %s: %s", folder, err)
        shutil.rmtree(folder, ignore_errors=True)
        progress = PretokProgress(strategy.name, info.id)
        catalogue.save_pretok(progress)
    return progress


def pretokenize(
    root: Path,
    catalogue: Catalogue,
    strategy: Strategy,
    submdats: list[SubmdatInfo],
    *,
    processes: int,
    batch_size: int,
    progress: bool,
    trust_remote_code: bool = False,
) -> None:
    """Pretokenize every submdat of ``submdats`` (all complete imports) not done yet; the
    container's ``functions/`` run only with ``trust_remote_code``."""
    committed = {info.id: _committed(root, catalogue, strategy, info) for info in submdats}
    todo = [info for info in submdats if not committed[info.id].complete]
    pending = deque(todo)  # submdats not finished yet, in the order their batches come
    batches = (
        batch
        for info in todo
        for batch in read_batches(root, strategy, info, committed[info.id].documents,
                                  batch_size)
    )
    bar = tqdm(total=sum(info.documents for info in todo),
               initial=sum(committed[info.id].documents for info in todo),
               desc=f"pretokenize {strategy.name}", unit="doc", file=sys.stderr,
               disable=not progress)
    writer: PretokWriter | None = None  # of pending[0], once its first batch arrived

    def open_writer(info: SubmdatInfo) -> PretokWriter:
        folder = pretok_folder(root, strategy.name, info.name)
        return PretokWriter(folder, strategy.token_dtype, committed[info.id])

    def finish_first() -> None:
        """Complete ``pending[0]``, whose batches have all been written."""
        nonlocal writer
        info = pending.popleft()
        if writer is None:  # it had no batch left to write
            writer = open_writer(info)
        writer.finish()
        writer = None
        catalogue.save_pretok(replace(catalogue.pretok(strategy.name, info.id), complete=True))

    try:
        for batch, result in split_batches(root, strategy, batches, processes,
                                          trust_remote_code):
            while pending[0].id != batch.submdat.id:
                finish_first()
            if writer is None:
                writer = open_writer(batch.submdat)
            writer.write(result.tokens, result.chunks, result.doc_chunks)
            catalogue.save_pretok(writer.progress(strategy.name, batch.submdat.id))
            bar.update(len(batch.documents))
        while pending:
            finish_first()
    finally:
        bar.close()
        if writer is not None:
            writer.close()
