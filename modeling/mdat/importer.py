"""Importing records into a submdat, batch by batch, resumable after an interruption.

Each batch is committed in this order: the LMDB transactions of ``data.db`` and ``meta.db``,
``sizes.npy``, then the catalogue row with the new counters and the sha256 of every record
consumed so far. The catalogue row is the truth: documents past its count are invisible to
readers and are overwritten when the import is run again. A resumed import reads the
``records_read`` records it already consumed again, and goes on only if they hash the same,
so an interrupted import never continues with another input. Only a row marked complete
takes part in pretokenization and views.
"""

from __future__ import annotations

import hashlib
import shutil
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from contextlib import closing
from dataclasses import replace
from itertools import islice
from pathlib import Path
from typing import Any

from tqdm import tqdm

from matformer.modeling.errors import BadRecord, EmptyDocument, NameTaken, NotUtf8, ResumeMismatch
from matformer.modeling.mdat.catalogue import Catalogue, SubmdatInfo
from matformer.modeling.mdat.records import Document, Record, record_bytes
from matformer.modeling.mdat.submdat import SubmdatWriter

# The counter of skipped records each kind of bad record adds to.
_SKIPPED_AS = {BadRecord: "invalid", NotUtf8: "not_utf8", EmptyDocument: "empty"}
# A batch is committed at ``batch_size`` documents or this much text, whichever comes first,
# so that large documents never pile up in memory.
COMMIT_BYTES = 32 << 20


def _start(catalogue: Catalogue, folder: Path, name: str, source: str, text_field: str,
           compression: str) -> SubmdatInfo:
    """The committed state to continue from: a new row, or an interrupted import's row."""
    existing = {info.name: info for info in catalogue.submdats()}.get(name)
    if existing is None:
        shutil.rmtree(folder, ignore_errors=True)  # left over from an interrupted removal
        return catalogue.new_submdat(name, source, text_field, compression)
    if existing.complete:
        raise NameTaken(f"submdat {name!r} exists already; import under another name.")
    wanted = (source, text_field, compression)
    found = (existing.source, existing.text_field, existing.compression)
    if wanted != found:
        raise ResumeMismatch(
            f"submdat {name!r} was interrupted while importing (source, text field, "
            f"compression) = {found}; resume it with exactly those, not {wanted}, or remove "
            "it (`matformer-mdat remove`) and import again."
        )
    return existing


def _check_consumed(records: Iterator[Record], info: SubmdatInfo, hashed: Any) -> None:
    """Feed the first ``records_read`` records to ``hashed``; they must hash as committed."""
    for record in islice(records, info.records_read):
        hashed.update(record_bytes(record))
    if hashed.hexdigest() != info.records_sha256:
        raise ResumeMismatch(
            f"submdat {info.name!r} was interrupted after {info.records_read} records, but "
            "the input given now does not start with the same records; resume with the same "
            "input, or remove the submdat (`matformer-mdat remove`) and import again."
        )


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
    info = _start(catalogue, folder, name, source, text_field, "zstd" if compress else "none")
    records = iter(records)
    hashed = hashlib.sha256()  # of every record consumed, skipped ones included
    _check_consumed(records, info, hashed)
    skipped: Counter[str] = Counter()
    batch: list[Document] = []
    held = 0  # bytes of text in ``batch``
    read = info.records_read
    writer = SubmdatWriter(folder, info.compression == "zstd", info.documents)
    with closing(writer), tqdm(desc=f"import {name}", unit="doc", initial=read,
                               file=sys.stderr, disable=not progress) as bar:

        def commit() -> SubmdatInfo:
            stored = writer.write(batch)
            done = replace(
                info, records_read=read, records_sha256=hashed.hexdigest(),
                documents=writer.documents,
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

        for record in records:
            read += 1
            hashed.update(record_bytes(record))
            bar.update()
            if isinstance(record, Document):
                batch.append(record)
                held += len(record.text)
            elif skip_bad:
                skipped[_SKIPPED_AS[type(record)]] += 1
            else:
                raise record
            if len(batch) >= batch_size or held >= COMMIT_BYTES:
                info, held = commit(), 0
        info = replace(commit(), complete=True)
        catalogue.save_submdat(info)
    return info
