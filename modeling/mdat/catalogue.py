"""``mdat.db``: the container's catalogue of submdats, strategies, views and shuffles.

One SQLite file, written only inside transactions. A row's counters are the committed
progress of the step that owns it: readers trust them, and an interrupted step resumes from
them. Rows are mirrored by small dataclasses whose field names are the column names.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Any

from modeling.errors import MdatNotFound, SubmdatLimit, UnknownName

CATALOGUE_NAME = "mdat.db"
FORMAT_VERSION = "1"
# Ids are 1 byte (or 2 in extended mode), so a (submdat, document) pair packs tightly.
MAX_SUBMDATS = {False: 255, True: 65_535}

_SCHEMA = """
CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE submdats (
    id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, source TEXT NOT NULL,
    text_field TEXT NOT NULL, compression TEXT NOT NULL, complete INTEGER NOT NULL,
    records_read INTEGER NOT NULL, documents INTEGER NOT NULL, raw_bytes INTEGER NOT NULL,
    stored_bytes INTEGER NOT NULL, skipped_empty INTEGER NOT NULL,
    skipped_invalid INTEGER NOT NULL, skipped_not_utf8 INTEGER NOT NULL);
CREATE TABLE strategies (name TEXT PRIMARY KEY, definition TEXT NOT NULL);
CREATE TABLE pretok (
    strategy TEXT NOT NULL, submdat_id INTEGER NOT NULL, complete INTEGER NOT NULL,
    documents INTEGER NOT NULL, tokens INTEGER NOT NULL, chunks INTEGER NOT NULL,
    PRIMARY KEY (strategy, submdat_id));
CREATE TABLE views (name TEXT PRIMARY KEY, definition TEXT NOT NULL);
CREATE TABLE shuffles (
    name TEXT PRIMARY KEY, view TEXT NOT NULL, strategy TEXT NOT NULL,
    max_seq_len INTEGER NOT NULL, seed INTEGER NOT NULL, sequences INTEGER NOT NULL);
"""


@dataclass(frozen=True, slots=True)
class SubmdatInfo:
    """A submdat's catalogue row: where it came from and what its import has committed."""

    id: int
    name: str
    source: str  # the file or folder imported, or "python" for an iterable of dicts
    text_field: str
    compression: str  # "zstd" or "none"
    complete: bool = False
    records_read: int = 0  # input records consumed, skipped ones included (the resume point)
    documents: int = 0
    raw_bytes: int = 0  # UTF-8 bytes of the stored texts
    stored_bytes: int = 0  # the same texts as stored (after compression)
    skipped_empty: int = 0
    skipped_invalid: int = 0  # not JSON, not an object, or without the text field
    skipped_not_utf8: int = 0


@dataclass(frozen=True, slots=True)
class PretokProgress:
    """What pretokenizing one submdat with one strategy has committed."""

    strategy: str
    submdat_id: int
    complete: bool = False
    documents: int = 0
    tokens: int = 0
    chunks: int = 0


@dataclass(frozen=True, slots=True)
class ShuffleInfo:
    name: str
    view: str
    strategy: str
    max_seq_len: int
    seed: int
    sequences: int


def _columns(row_type: type) -> str:
    return ", ".join(f.name for f in fields(row_type))


def _placeholders(row_type: type) -> str:
    return ", ".join("?" for _ in fields(row_type))


def _row(row_type: type, values: tuple[Any, ...]) -> Any:
    """A row dataclass from SQLite values (which stores booleans as 0 and 1)."""
    return row_type(*(
        bool(value) if spec.type == "bool" else value
        for spec, value in zip(fields(row_type), values, strict=True)
    ))


class Catalogue:
    """The open ``mdat.db`` of one container."""

    def __init__(self, connection: sqlite3.Connection) -> None:
        self._db = connection

    @classmethod
    def create(cls, folder: Path, *, extended: bool) -> Catalogue:
        db = sqlite3.connect(folder / CATALOGUE_NAME)
        with db:
            db.executescript(_SCHEMA)
            db.executemany("INSERT INTO settings VALUES (?, ?)", [
                ("format_version", FORMAT_VERSION), ("extended", json.dumps(extended)),
            ])
        return cls(db)

    @classmethod
    def open(cls, folder: Path) -> Catalogue:
        path = folder / CATALOGUE_NAME
        if not path.is_file():
            raise MdatNotFound(
                f"{folder} is not an MDAT container (no {CATALOGUE_NAME}); create one with "
                "`matformer-mdat create` or Mdat.create()."
            )
        return cls(sqlite3.connect(path))

    def close(self) -> None:
        self._db.close()

    @property
    def extended(self) -> bool:
        row = self._db.execute("SELECT value FROM settings WHERE key = 'extended'").fetchone()
        return bool(json.loads(row[0]))

    # Submdats.

    def submdats(self) -> list[SubmdatInfo]:
        rows = self._db.execute(f"SELECT {_columns(SubmdatInfo)} FROM submdats ORDER BY id")
        return [_row(SubmdatInfo, row) for row in rows]

    def submdat(self, name: str) -> SubmdatInfo:
        by_name = {info.name: info for info in self.submdats()}
        if name not in by_name:
            raise unknown("submdat", name, by_name)
        return by_name[name]

    def new_submdat(self, name: str, source: str, text_field: str, compression: str) -> SubmdatInfo:
        """Insert the row of a submdat whose import starts now, with the next free id."""
        limit = MAX_SUBMDATS[self.extended]
        (last,) = self._db.execute("SELECT COALESCE(MAX(id), 0) FROM submdats").fetchone()
        if last >= limit:
            raise SubmdatLimit(
                f"the container holds {limit} submdats, its maximum; create the container "
                "with extended=True (`matformer-mdat create --extended`) for up to 65,535."
            )
        info = SubmdatInfo(last + 1, name, source, text_field, compression)
        self.save_submdat(info)
        return info

    def save_submdat(self, info: SubmdatInfo) -> None:
        with self._db:
            self._db.execute(
                f"INSERT OR REPLACE INTO submdats ({_columns(SubmdatInfo)}) "
                f"VALUES ({_placeholders(SubmdatInfo)})", astuple(info),
            )

    # Strategies and their pretokenization progress.

    def strategies(self) -> dict[str, dict[str, Any]]:
        rows = self._db.execute("SELECT name, definition FROM strategies ORDER BY name")
        return {name: json.loads(definition) for name, definition in rows}

    def add_strategy(self, name: str, definition: dict[str, Any]) -> None:
        with self._db:
            self._db.execute("INSERT INTO strategies VALUES (?, ?)", (name, json.dumps(definition)))

    def pretok(self, strategy: str, submdat_id: int) -> PretokProgress:
        row = self._db.execute(
            f"SELECT {_columns(PretokProgress)} FROM pretok WHERE strategy = ? AND submdat_id = ?",
            (strategy, submdat_id),
        ).fetchone()
        return _row(PretokProgress, row) if row else PretokProgress(strategy, submdat_id)

    def save_pretok(self, progress: PretokProgress) -> None:
        with self._db:
            self._db.execute(
                f"INSERT OR REPLACE INTO pretok ({_columns(PretokProgress)}) "
                f"VALUES ({_placeholders(PretokProgress)})", astuple(progress),
            )

    # Views and shuffles.

    def views(self) -> dict[str, dict[str, Any]]:
        rows = self._db.execute("SELECT name, definition FROM views ORDER BY name")
        return {name: json.loads(definition) for name, definition in rows}

    def add_view(self, name: str, definition: dict[str, Any]) -> None:
        with self._db:
            self._db.execute("INSERT INTO views VALUES (?, ?)", (name, json.dumps(definition)))

    def shuffles(self) -> list[ShuffleInfo]:
        rows = self._db.execute(f"SELECT {_columns(ShuffleInfo)} FROM shuffles ORDER BY name")
        return [_row(ShuffleInfo, row) for row in rows]

    def add_shuffle(self, info: ShuffleInfo) -> None:
        with self._db:
            self._db.execute(
                f"INSERT OR REPLACE INTO shuffles VALUES ({_placeholders(ShuffleInfo)})",
                astuple(info),
            )


def unknown(kind: str, name: str, known: Any) -> UnknownName:
    listing = ", ".join(sorted(known)) or "none yet"
    return UnknownName(f"unknown {kind} {name!r}; the container has: {listing}.")
