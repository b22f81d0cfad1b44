"""Records from tables: Parquet files, and the Arrow tables `datasets` keeps (`hf_datasets.py`).

Only the text column is read, ``ROWS_PER_READ`` rows at a time, so a file of any size takes
the memory of one batch of one column, and every other column stays on disk. Each row is one
record (`records.cell_record`), named in errors by file and row (rows count from 0). pyarrow
is optional: without it these sources raise `FormatUnavailable` naming the extra to install.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from modeling.errors import FormatUnavailable, MissingTextColumn, SourceNotFound, UnreadableSource
from modeling.mdat.records import Record, cell_record

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

FORMATS_EXTRA = "pip install 'matformer[formats]'"
ROWS_PER_READ = 1024  # rows decoded per step; memory holds one such batch of the text column


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


def check_column(columns: Sequence[str], text_field: str, where: str) -> None:
    if text_field not in columns:
        raise MissingTextColumn(
            f"{where} has no column {text_field!r} (columns: {', '.join(columns) or 'none'}); "
            "choose the text column with text_field= (--text-field)."
        )


def parquet_source(files: Iterable[str | Path], text_field: str,
                   description: str | None = None) -> TableSource:
    """Every row of ``files``, in order; each file's footer is checked before any row is read,
    so a wrong file or column stops the import before it starts. ``description``: the
    catalogue's source (default: the absolute paths)."""
    pyarrow = _pyarrow("Parquet files")
    # Absolute, links kept: a hub cache links its files to blobs named by hash.
    resolved = [Path(os.path.abspath(file)) for file in files]
    if not resolved:
        raise SourceNotFound("no Parquet file given; name at least one.")
    for file in resolved:
        if not file.is_file():
            raise SourceNotFound(f"Parquet file {file} does not exist; check the path.")
        with _open(pyarrow, file) as table:
            check_column(table.schema_arrow.names, text_field, str(file))
    return TableSource(description or ", ".join(map(str, resolved)),
                       _parquet_records(pyarrow, resolved, text_field))


def _pyarrow(reading: str) -> ModuleType:
    """pyarrow, its ``parquet`` module imported."""
    optional_module("pyarrow.parquet", reading)
    return optional_module("pyarrow", reading)


def _open(pyarrow: ModuleType, file: Path) -> pq.ParquetFile:
    try:
        return pyarrow.parquet.ParquetFile(file)
    except pyarrow.ArrowInvalid as err:
        raise UnreadableSource(f"{file} cannot be read as Parquet ({err}); check the file.") \
            from err


def _parquet_records(pyarrow: ModuleType, files: list[Path],
                     text_field: str) -> Iterator[Record]:
    for file in files:
        with _open(pyarrow, file) as table:
            # Decodes the text column's pages of one row group after another, never the file.
            batches = table.iter_batches(batch_size=ROWS_PER_READ, columns=[text_field])
            try:
                yield from table_records(batches, text_field, str(file))
            except (OSError, pyarrow.ArrowInvalid) as err:  # pyarrow names no file
                raise UnreadableSource(
                    f"{file} could not be read to its end ({' '.join(str(err).split())}); "
                    "if it is damaged, write or download it again, then run the same add "
                    "(the import resumes)."
                ) from err


def table_records(batches: Iterable[pa.RecordBatch | pa.Table], text_field: str,
                  where: str) -> Iterator[Record]:
    """One record per row of ``batches``, whose only column holds the text."""
    pyarrow = _pyarrow("tables")
    as_bytes = {pyarrow.string(): pyarrow.binary(), pyarrow.large_string(): pyarrow.large_binary()}
    row = 0
    for batch in batches:
        column = batch.column(0)  # an Array of a RecordBatch, a ChunkedArray of a Table
        for chunk in column.chunks if isinstance(column, pyarrow.ChunkedArray) else [column]:
            binary = as_bytes.get(chunk.type)  # UTF-8 is checked per row (`cell_record`)
            for text in (chunk.view(binary) if binary else chunk).to_pylist():
                yield cell_record(text, text_field, f"{where} row {row}")
                row += 1
