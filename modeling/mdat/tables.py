"""Records from tables: Parquet files, and the Arrow files of `datasets` (`saved_datasets.py`).

Only the text column is read, a bounded batch at a time, so a file of any size takes the
memory of one batch of one column, and every other column stays on disk. A tiny file can
decode to any size (a decompression bomb: one value repeated through a dictionary, pages that
compress ten-thousandfold), so what is read is bounded by what the file declares, checked
against the read limit (`read_limit`) before a row is decoded: no Parquet page may declare
more than the limit (pyarrow decompresses a page whole); a batch holds so few rows that, even
if each repeats the largest value a page could hold, it decodes to ``BATCH_BYTES`` at most;
and what is decoded is counted, so that a cell past the limit, or a file decoding to more
than the limit past what its pages declare, stops the import (`ImportTooLarge`). Each row is
one record (`records.cell_record`), named in errors by file and row (rows count from 0).
pyarrow is optional: without it these sources raise `FormatUnavailable` naming the extra.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from matformer.modeling.errors import (
    ConfigError,
    FormatUnavailable,
    ImportTooLarge,
    MissingTextColumn,
    SourceNotFound,
    UnreadableSource,
)
from matformer.modeling.mdat.parquet_pages import ChunkPages, text_column_pages
from matformer.modeling.mdat.records import Record, cell_record

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

FORMATS_EXTRA = "pip install 'matformer[formats]'"
ROWS_PER_READ = 1024  # rows decoded per step at most
BATCH_BYTES = 32 << 20  # text decoded, and turned into Python objects, per step at most
STREAM_BYTES = 1 << 20  # a Parquet column chunk is read through a buffer this large
READ_LIMIT_MIB = 256  # the default read limit
READ_LIMIT_ENV = "MATFORMER_MDAT_READ_LIMIT_MIB"


@dataclass(frozen=True, slots=True)
class TableSource:
    """What an import reads: its records, and the catalogue's name for them."""

    description: str  # the submdat's source: a resume under another description is refused
    records: Iterator[Record]


def optional_module(name: str, reading: str) -> ModuleType:
    """Import ``name``, or say which extra gives it."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        raise FormatUnavailable(
            f"reading {reading} needs the {name.split('.')[0]} package, which is not "
            f"installed: {FORMATS_EXTRA}"
        ) from err


def pyarrow_module(reading: str) -> ModuleType:
    """pyarrow, its ``parquet`` and ``compute`` modules imported."""
    for module in ("pyarrow.parquet", "pyarrow.compute"):
        optional_module(module, reading)
    return optional_module("pyarrow", reading)


def read_limit() -> int:
    """The most text, in bytes, an import takes in at once: what one Parquet page may
    declare, one cell may hold, and a file may decode to past what its pages declare.
    ``READ_LIMIT_MIB`` MiB, unless the environment sets ``MATFORMER_MDAT_READ_LIMIT_MIB``."""
    value = os.environ.get(READ_LIMIT_ENV, str(READ_LIMIT_MIB))
    if not value.isdigit() or int(value) == 0:
        raise ConfigError(f"{READ_LIMIT_ENV}={value!r} is no positive whole number of MiB; "
                          f"set it to one, or unset it for the default {READ_LIMIT_MIB}.")
    return int(value) << 20


def _mib(size: int) -> str:
    return f"{size / 2**20:,.1f} MiB"


def _too_large(what: str, limit: int) -> ImportTooLarge:
    return ImportTooLarge(
        f"{what}, more than the read limit of {_mib(limit)}: a decompression bomb, or a file "
        "with very large values or many repeats; if you trust it, raise the limit "
        f"({READ_LIMIT_ENV}=1024 for 1 GiB)."
    )


def check_column(schema: pa.Schema, text_field: str, where: str) -> None:
    """``text_field`` is a column of ``schema`` holding text (or only nulls)."""
    pyarrow = pyarrow_module("tables")
    if text_field not in schema.names:
        raise MissingTextColumn(
            f"{where} has no column {text_field!r} (columns: "
            f"{', '.join(schema.names) or 'none'}); choose the text column with text_field= "
            "(--text-field)."
        )
    kind = schema.field(text_field).type
    value = kind.value_type if pyarrow.types.is_dictionary(kind) else kind
    if not (_is_text(pyarrow, value) or pyarrow.types.is_null(value)):
        raise MissingTextColumn(
            f"{where} column {text_field!r} holds {kind}, not text (string or binary); "
            "choose the text column with text_field= (--text-field)."
        )


def _is_text(pyarrow: ModuleType, kind: pa.DataType) -> bool:
    types = pyarrow.types
    return (types.is_string(kind) or types.is_large_string(kind) or types.is_binary(kind)
            or types.is_large_binary(kind))


def parquet_source(files: Iterable[str | Path], text_field: str,
                   description: str | None = None, *, limit: int | None = None) -> TableSource:
    """Every row of ``files``, in order; each file's footer and page headers are checked
    before any row is read, so a wrong file or column, or a page declaring more text than
    ``limit`` (default `read_limit`), stops the import before it starts. ``description``:
    the catalogue's source (default: the absolute paths)."""
    pyarrow = pyarrow_module("Parquet files")
    limit = read_limit() if limit is None else limit
    # Absolute, links kept: a hub cache links its files to blobs named by hash.
    resolved = [Path(os.path.abspath(file)) for file in files]
    if not resolved:
        raise SourceNotFound("no Parquet file given; name at least one.")
    pages = []
    for file in resolved:
        if not file.is_file():
            raise SourceNotFound(f"Parquet file {file} does not exist; check the path.")
        with _open(pyarrow, file) as table:
            check_column(table.schema_arrow, text_field, str(file))
            chunks = text_column_pages(file, table.metadata, text_field)
        for group, chunk in enumerate(chunks):
            if chunk.largest > limit:
                raise _too_large(f"{file} row group {group} has a page of {_mib(chunk.largest)}"
                                 f" of text in column {text_field!r}", limit)
        pages.append(chunks)
    return TableSource(description or ", ".join(map(str, resolved)),
                       _parquet_records(pyarrow, resolved, pages, text_field, limit))


def _open(pyarrow: ModuleType, file: Path) -> pq.ParquetFile:
    try:
        return pyarrow.parquet.ParquetFile(file, buffer_size=STREAM_BYTES, pre_buffer=False)
    except (OSError, ValueError, pyarrow.ArrowException) as err:  # a damaged footer, too
        raise UnreadableSource(f"{file} cannot be read as Parquet ({' '.join(str(err).split())}"
                               "); check the file.") from err


def _parquet_records(pyarrow: ModuleType, files: list[Path], pages: list[list[ChunkPages]],
                     text_field: str, limit: int) -> Iterator[Record]:
    for file, chunks in zip(files, pages, strict=True):
        # A value lies within one page, but a dictionary or shared prefixes can repeat it in
        # every row: each row may decode to as much as the largest page.
        largest = max((chunk.largest for chunk in chunks), default=1)
        rows = max(1, min(ROWS_PER_READ, BATCH_BYTES // max(largest, 1)))
        with _open(pyarrow, file) as table:
            # Decodes the text column's pages of one row group after another, never the file.
            batches = table.iter_batches(batch_size=rows, columns=[text_field])
            try:
                yield from table_records(batches, text_field, str(file),
                                         declared=sum(chunk.total for chunk in chunks),
                                         limit=limit)
            except (OSError, pyarrow.ArrowException) as err:  # pyarrow names no file
                raise UnreadableSource(
                    f"{file} could not be read to its end ({' '.join(str(err).split())}); "
                    "if it is damaged, write or download it again, then run the same add "
                    "(the import resumes)."
                ) from err


def table_records(batches: Iterable[pa.RecordBatch], text_field: str, where: str, *,
                  declared: int, limit: int) -> Iterator[Record]:
    """One record per row of ``batches``, whose only column holds the text. A cell larger
    than ``limit``, or text past ``declared`` (what the file says it holds) plus ``limit``,
    is refused before its rows become Python objects, which they do a slice of at most
    ``ROWS_PER_READ`` rows and ``BATCH_BYTES`` at a time."""
    pyarrow = pyarrow_module("tables")
    row = decoded = 0
    for batch in batches:
        chunk = batch.column(0)
        sizes = _cell_bytes(pyarrow, chunk)
        ends = decoded + np.cumsum(sizes)  # text decoded once each row is
        if sizes.max(initial=0) > limit:
            at = int(np.argmax(sizes > limit))
            raise _too_large(f"{where} row {row + at} holds {_mib(int(sizes[at]))} of text",
                             limit)
        if len(ends) and ends[-1] > declared + limit:
            at = int(np.argmax(ends > declared + limit))
            raise _too_large(f"{where} decodes to more text than it declares "
                             f"({_mib(declared)}) by row {row + at}", limit)
        start = 0
        while start < len(chunk):  # slices of one row at least, else of at most BATCH_BYTES
            before = ends[start - 1] if start else decoded
            stop = min(start + ROWS_PER_READ,
                       max(start + 1, int(np.searchsorted(ends, before + BATCH_BYTES, "right"))))
            for text in _cells(pyarrow, chunk.slice(start, stop - start)):
                yield cell_record(text, text_field, f"{where} row {row}")
                row += 1
            start = stop
        decoded = int(ends[-1]) if len(ends) else decoded


def _cell_bytes(pyarrow: ModuleType, chunk: pa.Array) -> np.ndarray:
    """Each cell's text size in bytes, read from the offsets without decoding a dictionary (a
    null may count a few bytes: the sizes only need to bound what is decoded)."""
    if len(chunk) == 0 or pyarrow.types.is_null(chunk.type):
        return np.zeros(len(chunk), dtype=np.int64)
    if pyarrow.types.is_dictionary(chunk.type):
        indices = chunk.indices.fill_null(0) if chunk.indices.null_count else chunk.indices
        return _cell_bytes(pyarrow, chunk.dictionary)[indices.to_numpy()]
    wide = pyarrow.types.is_large_string(chunk.type) or pyarrow.types.is_large_binary(chunk.type)
    offsets = np.frombuffer(chunk.buffers()[1], np.int64 if wide else np.int32)
    offsets = offsets[chunk.offset:chunk.offset + len(chunk) + 1].astype(np.int64)
    return offsets[1:] - offsets[:-1]


def _cells(pyarrow: ModuleType, chunk: pa.Array) -> list[object]:
    """The cells of ``chunk`` as Python: text as bytes, so that UTF-8 is checked per row
    (`cell_record`), not by pyarrow for a whole batch; None for a null."""
    if pyarrow.types.is_dictionary(chunk.type):
        chunk = chunk.dictionary_decode()
    as_bytes = {pyarrow.string(): pyarrow.binary(),
                pyarrow.large_string(): pyarrow.large_binary()}.get(chunk.type)
    return (chunk.view(as_bytes) if as_bytes else chunk).to_pylist()
