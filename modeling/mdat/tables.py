"""Records from tables: Parquet files, and the Arrow files of `datasets` (`saved_datasets.py`).

Each row is one record (`records.cell_record`): its text column's cell is the text, and its
other cells are its metadata, one JSON field per column (`metadata_columns`). Only columns of
flat values are kept: text, numbers, booleans, nulls, and dates and times (as ISO text); a
column of other values (binary, lists, structs, maps, decimals) is left out, and a warning
names it, because JSON holds no bytes and a list cell can decode to any size however small
its pages. Columns are read a bounded batch of rows at a time, so a file of any size takes
the memory of one batch. A tiny file can decode to any size (a decompression bomb: one value
repeated through a dictionary, pages that compress ten-thousandfold), so what is read is
bounded by what the file declares, checked against the read limit (`read_limit`) before a
row is decoded: no Parquet page of a column read may declare more than the limit (pyarrow
decompresses a page whole); a batch holds so few rows that, even if each repeats the largest
value the pages of each text column could hold, it decodes to ``BATCH_BYTES`` at most; and
what is decoded is counted, so that a cell past the limit, or a file whose text column
decodes to more than the limit past what its pages declare, stops the import
(`ImportTooLarge`). Metadata is not held to what its pages declare: a short value repeated
in every row (a language, a crawl name) is what metadata columns commonly hold. Rows are
named in errors by file and row (counted from 0). pyarrow is optional: without it these
sources raise `FormatUnavailable` naming the extra.
"""

from __future__ import annotations

import importlib
import logging
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
from matformer.modeling.mdat.parquet_pages import ChunkPages, column_pages
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
# What a cell of numbers, booleans, dates or times takes at most, as Python or as ISO text.
FLAT_CELL_BYTES = 40

log = logging.getLogger("matformer.mdat")


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


def _holds_text(pyarrow: ModuleType, kind: pa.DataType) -> bool:
    """Whether cells of ``kind`` are text, whose size only their pages bound."""
    return _is_text(pyarrow, kind.value_type if pyarrow.types.is_dictionary(kind) else kind)


def _is_flat(pyarrow: ModuleType, kind: pa.DataType) -> bool:
    """Whether a column of ``kind`` can be metadata: values JSON holds, of bounded size per
    row (text: as large as a page at most)."""
    types = pyarrow.types
    value = kind.value_type if types.is_dictionary(kind) else kind
    return (types.is_string(value) or types.is_large_string(value) or types.is_integer(value)
            or (types.is_floating(value) and not types.is_float16(value))
            or types.is_boolean(value) or types.is_null(value) or types.is_date(value)
            or types.is_timestamp(value) or types.is_time(value))


def metadata_columns(schema: pa.Schema, text_field: str) -> tuple[list[str], list[str]]:
    """(the columns of ``schema`` kept as metadata, in order; those left out, with their
    types): every column but the text one, if its values are flat (`_is_flat`)."""
    pyarrow = pyarrow_module("tables")
    kept, left_out = [], []
    for field in schema:
        if field.name == text_field:
            continue
        if _is_flat(pyarrow, field.type):
            kept.append(field.name)
        else:
            left_out.append(f"{field.name} ({field.type})")
    return kept, left_out


def warn_left_out(where: str, left_out: Iterable[str]) -> None:
    """Say once per import which columns its documents' metadata goes without."""
    names = sorted(set(left_out))
    if names:
        log.warning("matformer.mdat: %s: columns %s are not kept as metadata: it holds text, "
                    "numbers, booleans, nulls, dates and times only", where, ", ".join(names))


@dataclass(frozen=True, slots=True)
class _ParquetRead:
    """What is read of one Parquet file, and the bounds its page headers give."""

    file: Path
    columns: list[str]  # the text column, then those kept as metadata
    declared: int  # bytes the text column's pages declare, decompressed
    row_bytes: int  # the most one row of ``columns`` can decode to


def _row_bound(pages: dict[str, list[ChunkPages]], texts: list[str]) -> int:
    """The most one row can decode to: a value lies within one page, but a dictionary or
    shared prefixes can repeat it in every row, so a text cell may be as large as its column's
    largest page; any other cell holds one flat value."""
    groups = zip(*pages.values(), strict=True)  # the columns' chunks, row group by row group
    return max((sum(chunk.largest if column in texts else FLAT_CELL_BYTES
                    for column, chunk in zip(pages, chunks, strict=True))
                for chunks in groups), default=1)


def parquet_source(files: Iterable[str | Path], text_field: str,
                   description: str | None = None, *, limit: int | None = None) -> TableSource:
    """Every row of ``files``, in order; each file's footer and the page headers of the
    columns read are checked before any row is read, so a wrong file or column, or a page
    declaring more than ``limit`` (default `read_limit`), stops the import before it starts.
    ``description``: the catalogue's source (default: the absolute paths)."""
    pyarrow = pyarrow_module("Parquet files")
    limit = read_limit() if limit is None else limit
    # Absolute, links kept: a hub cache links its files to blobs named by hash.
    resolved = [Path(os.path.abspath(file)) for file in files]
    if not resolved:
        raise SourceNotFound("no Parquet file given; name at least one.")
    reads, left_out = [], []
    for file in resolved:
        if not file.is_file():
            raise SourceNotFound(f"Parquet file {file} does not exist; check the path.")
        with _open(pyarrow, file) as table:
            schema = table.schema_arrow
            check_column(schema, text_field, str(file))
            kept, left = metadata_columns(schema, text_field)
            pages = {column: column_pages(file, table.metadata, column)
                     for column in [text_field, *kept]}
        for column, chunks in pages.items():
            for group, chunk in enumerate(chunks):
                if chunk.largest > limit:
                    raise _too_large(f"{file} row group {group} has a page of "
                                     f"{_mib(chunk.largest)} in column {column!r}", limit)
        texts = [column for column in pages if _holds_text(pyarrow, schema.field(column).type)]
        reads.append(_ParquetRead(file, list(pages), sum(c.total for c in pages[text_field]),
                                  _row_bound(pages, texts)))
        left_out.extend(left)
    warn_left_out(description or ", ".join(map(str, resolved)), left_out)
    return TableSource(description or ", ".join(map(str, resolved)),
                       _parquet_records(pyarrow, reads, text_field, limit))


def _open(pyarrow: ModuleType, file: Path) -> pq.ParquetFile:
    try:
        return pyarrow.parquet.ParquetFile(file, buffer_size=STREAM_BYTES, pre_buffer=False)
    except (OSError, ValueError, pyarrow.ArrowException) as err:  # a damaged footer, too
        raise UnreadableSource(f"{file} cannot be read as Parquet ({' '.join(str(err).split())}"
                               "); check the file.") from err


def _parquet_records(pyarrow: ModuleType, reads: list[_ParquetRead], text_field: str,
                     limit: int) -> Iterator[Record]:
    for read in reads:
        rows = max(1, min(ROWS_PER_READ, BATCH_BYTES // max(read.row_bytes, 1)))
        file = read.file
        with _open(pyarrow, file) as table:
            # Decodes the pages of the columns read, one row group after another, never the file.
            batches = table.iter_batches(batch_size=rows, columns=read.columns)
            try:
                yield from table_records(batches, text_field, str(file),
                                         declared=read.declared, limit=limit)
            except (OSError, pyarrow.ArrowException) as err:  # pyarrow names no file
                raise UnreadableSource(
                    f"{file} could not be read to its end ({' '.join(str(err).split())}); "
                    "if it is damaged, write or download it again, then run the same add "
                    "(the import resumes)."
                ) from err


def table_records(batches: Iterable[pa.RecordBatch], text_field: str, where: str, *,
                  declared: int, limit: int) -> Iterator[Record]:
    """One record per row of ``batches``, which hold the text column and the metadata ones.
    A cell larger than ``limit``, or text past ``declared`` (what the file says its text
    column holds) plus ``limit``, is refused before its rows become Python objects, which they
    do a slice of at most ``ROWS_PER_READ`` rows and ``BATCH_BYTES`` at a time."""
    pyarrow = pyarrow_module("tables")
    row = decoded = 0
    for batch in batches:
        chunk = batch.column(text_field)
        others = {name: batch.column(name) for name in batch.schema.names if name != text_field}
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
        row_bytes = sizes.copy()  # (rows,) what each row turns into as Python objects
        for name, column in others.items():
            cells = _cell_bytes(pyarrow, column)
            if cells.max(initial=0) > limit:
                at = int(np.argmax(cells > limit))
                raise _too_large(f"{where} row {row + at} column {name!r} holds "
                                 f"{_mib(int(cells[at]))}", limit)
            row_bytes += cells
        held = np.cumsum(row_bytes)  # held as Python objects once each row is
        start = 0
        while start < len(chunk):  # slices of one row at least, else of at most BATCH_BYTES
            before = held[start - 1] if start else 0
            stop = min(start + ROWS_PER_READ,
                       max(start + 1, int(np.searchsorted(held, before + BATCH_BYTES, "right"))))
            metadata = {name: _cells(pyarrow, column.slice(start, stop - start))
                        for name, column in others.items()}
            for at, text in enumerate(_cells(pyarrow, chunk.slice(start, stop - start))):
                yield cell_record(text, text_field, f"{where} row {row}",
                                  {name: cells[at] for name, cells in metadata.items()})
                row += 1
            start = stop
        decoded = int(ends[-1]) if len(ends) else decoded


def _cell_bytes(pyarrow: ModuleType, chunk: pa.Array) -> np.ndarray:
    """Each cell's size in bytes: a text cell's read from the offsets without decoding a
    dictionary (a null may count a few bytes: the sizes only need to bound what is decoded),
    any other flat cell's at most ``FLAT_CELL_BYTES``."""
    if len(chunk) == 0 or pyarrow.types.is_null(chunk.type):
        return np.zeros(len(chunk), dtype=np.int64)
    if pyarrow.types.is_dictionary(chunk.type):
        indices = chunk.indices.fill_null(0) if chunk.indices.null_count else chunk.indices
        return _cell_bytes(pyarrow, chunk.dictionary)[indices.to_numpy()]
    if not _is_text(pyarrow, chunk.type):
        return np.full(len(chunk), FLAT_CELL_BYTES, dtype=np.int64)
    wide = pyarrow.types.is_large_string(chunk.type) or pyarrow.types.is_large_binary(chunk.type)
    offsets = np.frombuffer(chunk.buffers()[1], np.int64 if wide else np.int32)
    offsets = offsets[chunk.offset:chunk.offset + len(chunk) + 1].astype(np.int64)
    return offsets[1:] - offsets[:-1]


def _cells(pyarrow: ModuleType, chunk: pa.Array) -> list[object]:
    """The cells of ``chunk`` as Python: text as bytes, so that UTF-8 is checked per row
    (`cell_record`), not by pyarrow for a whole batch; dates and times as ISO text; None for
    a null."""
    if pyarrow.types.is_dictionary(chunk.type):
        chunk = chunk.dictionary_decode()
    if pyarrow.types.is_temporal(chunk.type):
        return pyarrow.compute.cast(chunk, pyarrow.string()).to_pylist()
    as_bytes = {pyarrow.string(): pyarrow.binary(),
                pyarrow.large_string(): pyarrow.large_binary()}.get(chunk.type)
    return (chunk.view(as_bytes) if as_bytes else chunk).to_pylist()
