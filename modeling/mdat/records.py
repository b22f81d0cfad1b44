"""Input records: JSONL lines, text files, Python dicts or table cells, turned into documents.

Each source yields, per input record, either a `Document` or the `BadRecord` / `NotUtf8` /
`EmptyDocument` error describing what is wrong with it (file and line or row, or record,
named), so the importer decides whether to raise or to skip and count. The sequence of
yielded items is deterministic for a given input, and `record_bytes` gives each one a
canonical encoding: an interrupted import hashes the records it consumed and checks, on
resume, that the input given again starts with the same ones. Table sources (Parquet,
`datasets`) live in `tables.py`, which needs pyarrow; JSON arrays in `json_arrays.py`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matformer.modeling.errors import BadRecord, EmptyDocument, NotUtf8

SKIP_HINT = "or pass skip_bad=True (--skip-bad) to skip and count such records"
_LENGTH = struct.Struct("<Q")  # how long the field after it is


@dataclass(frozen=True, slots=True)
class Document:
    """One document ready to store: its UTF-8 text and its metadata as JSON (or None)."""

    text: bytes
    metadata: bytes | None


Record = Document | BadRecord | NotUtf8 | EmptyDocument
# Makes the record of one JSON object or dict, given where it is (for its errors): a text
# field and metadata (`text_documents`), or a conversation (`modeling.mdat.conversations`).
ToRecord = Callable[[Mapping[str, Any], str], Record]


def record_bytes(record: Record) -> bytes:
    """An unambiguous encoding of ``record``: its kind, then its fields, length-prefixed."""
    if isinstance(record, Document):
        fields = [b"document", record.text, record.metadata or b""]
    else:
        fields = [type(record).__name__.encode(), str(record).encode("utf-8", "replace")]
    return b"".join(_LENGTH.pack(len(field)) + field for field in fields)


def document_from_dict(value: Mapping[str, Any], text_field: str, where: str) -> Record:
    """``value[text_field]`` becomes the text; every other field becomes metadata."""
    text = value.get(text_field)
    if not isinstance(text, str | bytes):
        return BadRecord(
            f"{where}: no text field {text_field!r} holding a string (fields: "
            f"{', '.join(map(str, value)) or 'none'}); choose the field with text_field= "
            f"(--text-field), {SKIP_HINT}."
        )
    return checked_document(text, where, {key: field for key, field in value.items()
                                          if key != text_field})


def text_documents(text_field: str) -> ToRecord:
    """Records of objects whose ``text_field`` is the text (`document_from_dict`)."""
    return lambda value, where: document_from_dict(value, text_field, where)


def cell_record(text: object, column: str, where: str,
                metadata: Mapping[str, object] | None = None) -> Record:
    """The text column's cell of one table row, with the row's other cells as its metadata.

    Cells of text columns come as bytes (a string column read as binary), so that invalid
    UTF-8 is named here, per row and column, and not by the table reader for a whole batch.
    """
    if text is None:
        return BadRecord(f"{where}: the text column {column!r} is null; {SKIP_HINT}.")
    if not isinstance(text, str | bytes):
        return BadRecord(
            f"{where}: column {column!r} holds a {type(text).__name__}, not text; choose the "
            f"text column with text_field= (--text-field), {SKIP_HINT}."
        )
    extra = {}
    for key, value in (metadata or {}).items():
        try:
            extra[key] = value.decode("utf-8") if isinstance(value, bytes) else value
        except UnicodeDecodeError as err:
            return NotUtf8(f"{where}: column {key!r} is not valid UTF-8 ({err.reason}); fix the "
                           f"input {SKIP_HINT}.")
    return checked_document(text, where, extra)


def checked_document(text: str | bytes, where: str, extra: Mapping[str, Any]) -> Record:
    """``text`` checked (UTF-8, not blank) and ``extra`` as JSON metadata (None if empty)."""
    try:
        raw = text.encode("utf-8") if isinstance(text, str) else text
        if isinstance(text, bytes):
            raw.decode("utf-8")
    except UnicodeError as err:
        return NotUtf8(
            f"{where}: text is not valid UTF-8 ({err.reason}); fix the input {SKIP_HINT}."
        )
    if not raw.strip():  # a document without tokens would make no sequence
        return EmptyDocument(f"{where}: the text is empty or only whitespace; remove the "
                             f"record {SKIP_HINT}.")
    try:
        metadata = json.dumps(extra, ensure_ascii=False).encode("utf-8") if extra else None
    except (TypeError, ValueError, UnicodeError) as err:
        return BadRecord(f"{where}: metadata cannot be stored as JSON ({err}); {SKIP_HINT}.")
    return Document(raw, metadata)


def dict_records(records: Iterable[Mapping[str, Any]], to_record: ToRecord) -> Iterator[Record]:
    for number, value in enumerate(records):
        where = f"record {number}"
        if not isinstance(value, Mapping):
            yield BadRecord(f"{where} is a {type(value).__name__}, not a dict; {SKIP_HINT}.")
            continue
        yield to_record(value, where)


def jsonl_records(file: Path, to_record: ToRecord) -> Iterator[Record]:
    """One record per non-blank line of a JSON Lines file (blank lines are not records)."""
    with open(file, "rb") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{file}:{number}"
            try:
                value = json.loads(line.decode("utf-8"))
            except UnicodeDecodeError as err:
                yield NotUtf8(
                    f"{where}: line is not valid UTF-8 ({err.reason} at byte {err.start}); "
                    f"fix the file {SKIP_HINT}."
                )
                continue
            except json.JSONDecodeError as err:
                yield BadRecord(f"{where}: not JSON ({err.msg}); fix the line {SKIP_HINT}.")
                continue
            if not isinstance(value, dict):
                kind = type(value).__name__
                yield BadRecord(f"{where}: a JSON {kind}, not an object; {SKIP_HINT}.")
                continue
            yield to_record(value, where)


def folder_records(folder: Path, pattern: str) -> Iterator[Record]:
    """One document per file matching ``pattern``, in sorted path order; metadata: its path."""
    for file in sorted(path for path in folder.glob(pattern) if path.is_file()):
        relative = file.relative_to(folder).as_posix()
        yield document_from_dict({"text": file.read_bytes(), "path": relative}, "text", str(file))
