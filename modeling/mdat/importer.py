"""Importing records into a submdat, batch by batch, resumable after an interruption.

Each batch is committed in this order: the LMDB transactions of ``data.db`` and ``meta.db``,
``sizes.npy``, then the catalogue row with the new counters. The catalogue row is the truth:
documents past its count are invisible to readers and are overwritten when the import is run
again with the same source, which skips the ``records_read`` records it already consumed.
Only a row marked complete takes part in pretokenization and views.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable
from dataclasses import replace
from itertools import islice
from pathlib import Path

from tqdm import tqdm

from modeling.errors import BadRecord, NameTaken, NotUtf8, ResumeMismatch
from modeling.mdat.catalogue import Catalogue, SubmdatInfo
from modeling.mdat.records import Document, Record
from modeling.mdat.submdat import SubmdatWriter


def _start(
    catalogue: Catalogue, name: str, source: str, text_field: str, compression: str
) -> SubmdatInfo:
    """The committed state to continue from: a new row, or an interrupted import's row."""
    existing = {info.name: info for info in catalogue.submdats()}.get(name)
    if existing is None:
        return catalogue.new_submdat(name, source, text_field, compression)
    if existing.complete:
        raise NameTaken(f"submdat {name!r} exists already; import under another name.")
    wanted = (source, text_field, compression)
    found = (existing.source, existing.text_field, existing.compression)
    if wanted != found:
        raise ResumeMismatch(
            f"submdat {name!r} was interrupted while importing (source, text field, "
            f"compression) = {found}; resume it with exactly those, not {wanted}."
        )
    return existing


def import_records(
    catalogue: Catalogue,
    folder: Path,
    records: Iterable[Record],
    *,
    name: str,
    source: str,
    text_field: str,
    compress: bool,
    skip_bad: bool,
    batch_size: int,
    progress: bool,
) -> SubmdatInfo:
    """Store ``records`` as submdat ``name`` in ``folder``; returns its final catalogue row."""
    info = _start(catalogue, name, source, text_field, "zstd" if compress else "none")
    writer = SubmdatWriter(folder, info.compression == "zstd", info.documents)
    skipped: Counter[str] = Counter()
    batch: list[Document] = []
    read = info.records_read
    bar = tqdm(desc=f"import {name}", unit="doc", initial=read, file=sys.stderr,
               disable=not progress)

    def commit() -> SubmdatInfo:
        stored = writer.write(batch)
        done = replace(
            info, records_read=read, documents=writer.documents,
            raw_bytes=info.raw_bytes + sum(len(d.text) for d in batch),
            stored_bytes=info.stored_bytes + stored,
            skipped_empty=info.skipped_empty + skipped["empty"],
            skipped_invalid=info.skipped_invalid + skipped["invalid"],
            skipped_not_utf8=info.skipped_not_utf8 + skipped["not_utf8"],
        )
        catalogue.save_submdat(done)
        batch.clear()
        skipped.clear()
        return done

    try:
        for record in islice(records, info.records_read, None):
            read += 1
            bar.update()
            if isinstance(record, BadRecord | NotUtf8):
                if not skip_bad:
                    raise record
                skipped["invalid" if isinstance(record, BadRecord) else "not_utf8"] += 1
            elif not record.text.strip():
                skipped["empty"] += 1  # a zero-token document would only break chunking
            else:
                batch.append(record)
            if len(batch) >= batch_size:
                info = commit()
        info = replace(commit(), complete=True)
        catalogue.save_submdat(info)
    finally:
        bar.close()
        writer.close()
    return info
