"""A submdat on disk: ``datasets/<name>/`` with its documents, metadata and sizes.

- ``data.db``: LMDB, key = big-endian document index, value = the UTF-8 text (zstd-compressed
  when the submdat was imported with compression).
- ``meta.db``: LMDB with the same keys, value = the record's other fields as JSON. Absent
  keys mean no metadata. Kept apart so heavy metadata never slows reading text.
- ``sizes.npy``: the UTF-8 byte length of every document, for size quotas without a scan.

Every file is committed before the catalogue row that counts its documents, so after a crash
a file may hold more than the row counts: readers use the first ``documents`` entries, and a
resumed import overwrites the rest.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import zstandard

from matformer.modeling.errors import MdatCorrupt
from matformer.modeling.mdat.catalogue import SubmdatInfo
from matformer.modeling.mdat.lmdb_files import acquire, damaged, document_key, grow, release
from matformer.modeling.mdat.npy_files import AppendableNpy, load_npy
from matformer.modeling.mdat.records import Document

DATA_NAME = "data.db"
META_NAME = "meta.db"
SIZES_NAME = "sizes.npy"
ZSTD_LEVEL = 3


class SubmdatWriter:
    """Appends documents after the ``committed`` ones; each batch is one LMDB transaction."""

    def __init__(self, folder: Path, compress: bool, committed: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        with ExitStack() as opened:  # what opened is closed again if a later file fails
            self._data = acquire(folder / DATA_NAME, create=True)
            opened.callback(release, self._data)
            self._meta = acquire(folder / META_NAME, create=True)
            opened.callback(release, self._meta)
            self._sizes = AppendableNpy(folder / SIZES_NAME, np.uint64, committed)
            opened.callback(self._sizes.close)
            self._close = opened.pop_all().close
        self._compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL) if compress else None
        self.documents = committed

    def write(self, batch: list[Document]) -> int:
        """Store ``batch`` durably; returns the bytes its texts take as stored."""
        values = [
            self._compressor.compress(d.text) if self._compressor else d.text for d in batch
        ]
        while True:
            try:
                self._put(batch, values)
                break
            except lmdb.MapFullError:
                grow(self._data)
                grow(self._meta)
        self.documents += len(batch)
        self._sizes.append(np.array([len(d.text) for d in batch], dtype=np.uint64))
        self._sizes.commit()
        return sum(len(value) for value in values)

    def _put(self, batch: list[Document], values: list[bytes]) -> None:
        with self._data.begin(write=True) as data, self._meta.begin(write=True) as meta:
            for index, (document, value) in enumerate(zip(batch, values, strict=True)):
                key = document_key(self.documents + index)
                data.put(key, value)
                if document.metadata is not None:
                    meta.put(key, document.metadata)

    def close(self) -> None:
        self._close()


class Submdat:
    """Read access to the committed documents of one submdat."""

    def __init__(self, folder: Path, info: SubmdatInfo) -> None:
        self.info = info
        self.folder = folder
        self.sizes = load_npy(  # (documents,) UTF-8 bytes
            folder / SIZES_NAME, info.documents, uncommitted_tail=True,
            fix="import the source again into a new container",
        )
        self._data = acquire(folder / DATA_NAME)
        try:
            self._meta = acquire(folder / META_NAME)
        except MdatCorrupt:
            release(self._data)
            raise
        # Released on close(), or when this reader is garbage-collected.
        self._release = weakref.finalize(self, _release_all, self._data, self._meta)
        self._decompressor = zstandard.ZstdDecompressor() if info.compression == "zstd" else None

    def __len__(self) -> int:
        return self.info.documents

    def raw(self, index: int) -> bytes:
        """The UTF-8 bytes of document ``index``."""
        return next(self.raw_range(index, index + 1))

    def text(self, index: int) -> str:
        return self.raw(index).decode("utf-8")

    def raw_range(self, start: int, stop: int) -> Iterator[bytes]:
        """The UTF-8 bytes of documents ``start .. stop - 1``, read with one cursor."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError(
                f"documents {start}..{stop} outside 0..{len(self)} of {self.info.name!r}"
            )
        path = self.folder / DATA_NAME
        try:
            with self._data.begin(buffers=False) as txn:
                cursor = txn.cursor()
                found = cursor.set_key(document_key(start)) if stop > start else False
                for index in range(start, stop):
                    if not found or cursor.key() != document_key(index):
                        raise damaged(path, KeyError(f"document {index} is missing"))
                    value = cursor.value()
                    yield self._decompressor.decompress(value) if self._decompressor else value
                    found = cursor.next()
        except (lmdb.Error, zstandard.ZstdError) as err:
            raise damaged(path, err) from err

    def metadata(self, index: int) -> dict[str, Any]:
        if not 0 <= index < len(self):
            raise IndexError(f"document {index} outside 0..{len(self)} of {self.info.name!r}")
        try:
            with self._meta.begin() as txn:
                value = txn.get(document_key(index))
            return json.loads(value) if value is not None else {}
        except (lmdb.Error, ValueError) as err:
            raise damaged(self.folder / META_NAME, err) from err

    def metadata_fields(self, documents: int = 100) -> list[str]:
        """The fields of the metadata of the first ``documents`` documents, in the order they
        first appear: what a listing shows without reading every document."""
        end = document_key(min(documents, len(self)))
        found: dict[str, None] = {}
        try:
            with self._meta.begin() as txn:
                for key, value in txn.cursor():
                    if key >= end:
                        break
                    found.update(dict.fromkeys(json.loads(value)))
        except (lmdb.Error, ValueError) as err:
            raise damaged(self.folder / META_NAME, err) from err
        return list(found)

    def close(self) -> None:
        self._release()


def _release_all(*envs: lmdb.Environment) -> None:
    for env in envs:
        release(env)
