"""Pretokenizing submdats with a strategy, resumable per submdat.

Documents go through the splitter in batches (`pretok_workers`). After each batch the files
are committed, then the catalogue's pretok row. A run skips complete submdats, continues a
partial one after its last committed batch (bytes written past it are cut off), and rebuilds
one whose files turn out shorter than the catalogue records.
"""

from __future__ import annotations

import logging
import shutil
import sys
from dataclasses import replace
from pathlib import Path

from tqdm import tqdm

from modeling.errors import MdatCorrupt
from modeling.mdat.catalogue import Catalogue, PretokProgress, SubmdatInfo
from modeling.mdat.pretok_files import PretokArrays, PretokWriter, pretok_folder
from modeling.mdat.pretok_workers import read_batches, split_batches
from modeling.mdat.strategy import Strategy

log = logging.getLogger("matformer.mdat")


def _writer(
    root: Path, catalogue: Catalogue, strategy: Strategy, info: SubmdatInfo
) -> PretokWriter:
    """A writer after the committed batches, or from scratch when the files are damaged."""
    folder = pretok_folder(root, strategy.name, info.name)
    progress = catalogue.pretok(strategy.name, info.id)
    try:
        return PretokWriter(folder, strategy.token_dtype, progress)
    except MdatCorrupt as err:
        log.warning("matformer.mdat: rebuilding %s: %s", folder, err)
        shutil.rmtree(folder)
        catalogue.save_pretok(PretokProgress(strategy.name, info.id))
        return PretokWriter(folder, strategy.token_dtype, PretokProgress(strategy.name, info.id))


def _is_complete(root: Path, catalogue: Catalogue, strategy: Strategy, info: SubmdatInfo) -> bool:
    progress = catalogue.pretok(strategy.name, info.id)
    if not progress.complete:
        return False
    try:
        PretokArrays.load(pretok_folder(root, strategy.name, info.name), progress)
    except MdatCorrupt as err:
        log.warning("matformer.mdat: rebuilding %s/%s: %s", strategy.name, info.name, err)
        shutil.rmtree(pretok_folder(root, strategy.name, info.name), ignore_errors=True)
        catalogue.save_pretok(PretokProgress(strategy.name, info.id))
        return False
    return True


def pretokenize(
    root: Path,
    catalogue: Catalogue,
    strategy: Strategy,
    submdats: list[SubmdatInfo],
    *,
    processes: int,
    batch_size: int,
    progress: bool,
) -> None:
    """Pretokenize every submdat of ``submdats`` (all complete imports) not done yet."""
    pending = [info for info in submdats if not _is_complete(root, catalogue, strategy, info)]
    writers = {info.name: _writer(root, catalogue, strategy, info) for info in pending}
    done = {info.name: catalogue.pretok(strategy.name, info.id).documents for info in pending}
    batches = (
        batch
        for info in pending
        for batch in read_batches(root, strategy, info, done[info.name], batch_size)
    )
    bar = tqdm(total=sum(info.documents for info in pending), initial=sum(done.values()),
               desc=f"pretokenize {strategy.name}", unit="doc", file=sys.stderr,
               disable=not progress)
    try:
        for batch, result in split_batches(root, strategy, batches, processes):
            writer = writers[batch.submdat.name]
            writer.write(result.tokens, result.chunks, result.doc_chunks)
            catalogue.save_pretok(writer.progress(strategy.name, batch.submdat.id))
            bar.update(len(batch.documents))
        for info in pending:
            writers[info.name].finish()
            committed = catalogue.pretok(strategy.name, info.id)
            catalogue.save_pretok(replace(committed, complete=True))
    finally:
        bar.close()
        for writer in writers.values():
            writer.close()
