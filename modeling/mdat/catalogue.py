"""``mdat.db``: the container's catalogue of submdats, strategies, views and shuffles.

One SQLite file, written only inside transactions. A row's counters are the committed
progress of the step that owns it: readers trust them, and an interrupted step resumes from
them. Rows are mirrored by small dataclasses whose field names are the column names. Any
SQLite failure to read the file surfaces as `MdatCorrupt` naming it.

The table ``view_pretok`` (the progress of views pretokenized on their own) came after format
2 was fixed, so it is created by its first write, in any container: until then it reads as
empty. Containers written before it stay readable, by this code and by the code that wrote
them (which ignores the table).
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
from dataclasses import astuple, dataclass, fields
from pathlib import Path
from typing import Any

from matformer.modeling.errors import (
    MdatCorrupt,
    MdatError,
    MdatFormatError,
    MdatNotFound,
    SubmdatLimit,
    UnknownName,
)

CATALOGUE_NAME = "mdat.db"
FORMAT_VERSION = "2"
# Ids are 1 byte (or 2 in extended mode), so a (submdat, document) pair packs tightly.
MAX_SUBMDATS = {False: 255, True: 65_535}
NOTHING_READ = hashlib.sha256().hexdigest()  # the records_sha256 of an import that read nothing

_SCHEMA = """
CREATE TABLE settings (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE submdats (
    id INTEGER PRIMARY KEY, name TEXT UNIQUE NOT NULL, source TEXT NOT NULL,
    text_field TEXT NOT NULL, compression TEXT NOT NULL, complete INTEGER NOT NULL,
    records_read INTEGER NOT NULL, records_sha256 TEXT NOT NULL, documents INTEGER NOT NULL,
    raw_bytes INTEGER NOT NULL, stored_bytes INTEGER NOT NULL, skipped_empty INTEGER NOT NULL,
    skipped_invalid INTEGER NOT NULL, skipped_not_utf8 INTEGER NOT NULL);
CREATE TABLE strategies (name TEXT PRIMARY KEY, definition TEXT NOT NULL);
CREATE TABLE pretok (
    strategy TEXT NOT NULL, submdat_id INTEGER NOT NULL, complete INTEGER NOT NULL,
    documents INTEGER NOT NULL, tokens INTEGER NOT NULL, chunks INTEGER NOT NULL,
    PRIMARY KEY (strategy, submdat_id));
CREATE TABLE views (name TEXT PRIMARY KEY, definition TEXT NOT NULL);
CREATE TABLE shuffles (
    name TEXT PRIMARY KEY, view TEXT NOT NULL, strategy TEXT NOT NULL,
    max_seq_len INTEGER NOT NULL, seed INTEGER NOT NULL, sequences INTEGER NOT NULL,
    fingerprint TEXT NOT NULL, dataset TEXT NOT NULL);
"""
# The pretok rows of views' own files (each: a view's chosen documents of one submdat).
_VIEW_PRETOK = """
CREATE TABLE IF NOT EXISTS view_pretok (
    view TEXT NOT NULL, strategy TEXT NOT NULL, submdat_id INTEGER NOT NULL,
    complete INTEGER NOT NULL, documents INTEGER NOT NULL, tokens INTEGER NOT NULL,
    chunks INTEGER NOT NULL, PRIMARY KEY (view, strategy, submdat_id));
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
    records_sha256: str = NOTHING_READ  # of those records: a resume must read the same ones
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
    fingerprint: str  # of the data it permutes (`Mdat.fingerprint`)
    dataset: str  # JSON of what the fingerprint hashes, to name what changed since


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


Statement = tuple[str, tuple[Any, ...]]


class Catalogue:
    """The open ``mdat.db`` of one container."""

    def __init__(self, connection: sqlite3.Connection, path: Path) -> None:
        self._db = connection
        self._path = path

    @classmethod
    def create(cls, folder: Path, *, extended: bool) -> Catalogue:
        path = folder / CATALOGUE_NAME
        catalogue = cls(sqlite3.connect(path), path)
        with catalogue._db:
            catalogue._db.executescript(_SCHEMA)
        catalogue._write(*(("INSERT INTO settings VALUES (?, ?)", setting) for setting in [
            ("format_version", FORMAT_VERSION), ("extended", json.dumps(extended)),
        ]))
        return catalogue

    @classmethod
    def open(cls, folder: Path) -> Catalogue:
        path = folder / CATALOGUE_NAME
        if not folder.exists():
            raise MdatNotFound(f"{folder}: no such file or folder; give the path of an MDAT "
                               "container (matformer mdat create makes one).")
        if not path.is_file():
            raise MdatNotFound(
                f"{folder} is not an MDAT container (no {CATALOGUE_NAME}); create one with "
                "`matformer-mdat create` or Mdat.create()."
            )
        catalogue = cls(sqlite3.connect(path), path)
        try:
            version = catalogue._setting("format_version")
        except MdatCorrupt:
            catalogue.close()
            raise
        if version != FORMAT_VERSION:
            catalogue.close()
            raise MdatFormatError(
                f"{folder} was written in MDAT format {version}; this code reads format "
                f"{FORMAT_VERSION}. Build the container again from its sources (the default "
                "container: delete the folder, it is built again on first use)."
            )
        return catalogue

    def close(self) -> None:
        self._db.close()

    def _rows(self, sql: str, values: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        try:
            return self._db.execute(sql, values).fetchall()
        except sqlite3.DatabaseError as err:
            raise self._damaged(err) from err

    def _write(self, *statements: Statement) -> None:
        """Run ``statements`` in one transaction: all of them take effect, or none."""
        try:
            with self._db:
                for sql, values in statements:
                    self._db.execute(sql, values)
        except sqlite3.DatabaseError as err:
            raise self._damaged(err) from err

    def _damaged(self, err: sqlite3.DatabaseError) -> MdatCorrupt:
        return MdatCorrupt(
            f"{self._path} cannot be read as an MDAT catalogue ({err}); copy it back from a "
            "backup, or build the container again from its sources."
        )

    def _setting(self, key: str) -> str:
        rows = self._rows("SELECT value FROM settings WHERE key = ?", (key,))
        if not rows:
            raise self._damaged(sqlite3.DatabaseError(f"no setting {key!r}"))
        return rows[0][0]

    @property
    def extended(self) -> bool:
        return bool(json.loads(self._setting("extended")))

    # Submdats.

    def submdats(self) -> list[SubmdatInfo]:
        rows = self._rows(f"SELECT {_columns(SubmdatInfo)} FROM submdats ORDER BY id")
        return [_row(SubmdatInfo, row) for row in rows]

    def submdat(self, name: str) -> SubmdatInfo:
        by_name = {info.name: info for info in self.submdats()}
        if name not in by_name:
            raise unknown("submdat", name, by_name)
        return by_name[name]

    def new_submdat(self, name: str, source: str, text_field: str, compression: str) -> SubmdatInfo:
        """Insert the row of a submdat whose import starts now, with the lowest free id."""
        limit = MAX_SUBMDATS[self.extended]
        taken = {info.id for info in self.submdats()}
        free = next((i for i in range(1, limit + 1) if i not in taken), None)
        if free is None:
            raise SubmdatLimit(
                f"the container holds {limit} submdats, its maximum; remove one, or create "
                "the container with extended=True (`matformer-mdat create --extended`) for up "
                "to 65,535."
            )
        info = SubmdatInfo(free, name, source, text_field, compression)
        self.save_submdat(info)
        return info

    def save_submdat(self, info: SubmdatInfo) -> None:
        self._write((f"INSERT OR REPLACE INTO submdats ({_columns(SubmdatInfo)}) "
                     f"VALUES ({_placeholders(SubmdatInfo)})", astuple(info)))

    def remove_submdat(self, info: SubmdatInfo, shuffles: list[str]) -> None:
        """Forget a submdat, its pretokenization progress and ``shuffles``, at once."""
        self._write(
            ("DELETE FROM submdats WHERE id = ?", (info.id,)),
            ("DELETE FROM pretok WHERE submdat_id = ?", (info.id,)),
            *(("DELETE FROM shuffles WHERE name = ?", (name,)) for name in shuffles),
        )

    # Strategies and their pretokenization progress.

    def strategies(self) -> dict[str, dict[str, Any]]:
        rows = self._rows("SELECT name, definition FROM strategies ORDER BY name")
        return {name: json.loads(definition) for name, definition in rows}

    def add_strategy(self, name: str, definition: dict[str, Any]) -> None:
        self._write(("INSERT INTO strategies VALUES (?, ?)", (name, json.dumps(definition))))

    def pretok(self, strategy: str, submdat_id: int, view: str | None = None) -> PretokProgress:
        """The progress of a submdat's pretokenization, or (``view``) of the view's own."""
        if view is None:
            rows = self._rows(f"SELECT {_columns(PretokProgress)} FROM pretok "
                              "WHERE strategy = ? AND submdat_id = ?", (strategy, submdat_id))
        elif self._has_view_pretok():
            rows = self._rows(f"SELECT {_columns(PretokProgress)} FROM view_pretok "
                              "WHERE view = ? AND strategy = ? AND submdat_id = ?",
                              (view, strategy, submdat_id))
        else:
            rows = []
        return _row(PretokProgress, rows[0]) if rows else PretokProgress(strategy, submdat_id)

    def save_pretok(self, progress: PretokProgress, view: str | None = None) -> None:
        if view is None:
            self._write((f"INSERT OR REPLACE INTO pretok ({_columns(PretokProgress)}) "
                         f"VALUES ({_placeholders(PretokProgress)})", astuple(progress)))
        else:
            self._write((_VIEW_PRETOK, ()), (
                f"INSERT OR REPLACE INTO view_pretok (view, {_columns(PretokProgress)}) "
                f"VALUES (?, {_placeholders(PretokProgress)})", (view, *astuple(progress))))

    def forget_view_pretok(self, view: str, strategy: str, submdat_id: int) -> None:
        """Drop a view's own progress on one submdat (its files go after)."""
        if self._has_view_pretok():
            self._write(("DELETE FROM view_pretok WHERE view = ? AND strategy = ? AND "
                         "submdat_id = ?", (view, strategy, submdat_id)))

    def _has_view_pretok(self) -> bool:
        return bool(self._rows("SELECT 1 FROM sqlite_master WHERE type = 'table' AND "
                               "name = 'view_pretok'"))

    # Views and shuffles.

    def views(self) -> dict[str, dict[str, Any]]:
        rows = self._rows("SELECT name, definition FROM views ORDER BY name")
        return {name: json.loads(definition) for name, definition in rows}

    def add_view(self, name: str, definition: dict[str, Any]) -> None:
        self._write(("INSERT INTO views VALUES (?, ?)", (name, json.dumps(definition))))

    def remove_view(self, name: str) -> None:
        """Forget a view, every shuffle of it and its own pretokenization, at once."""
        own = [("DELETE FROM view_pretok WHERE view = ?", (name,))] \
            if self._has_view_pretok() else []
        self._write(("DELETE FROM views WHERE name = ?", (name,)),
                    ("DELETE FROM shuffles WHERE view = ?", (name,)), *own)

    def shuffles(self) -> list[ShuffleInfo]:
        rows = self._rows(f"SELECT {_columns(ShuffleInfo)} FROM shuffles ORDER BY name")
        return [_row(ShuffleInfo, row) for row in rows]

    def add_shuffle(self, info: ShuffleInfo) -> None:
        """Record ``info``. A shuffle is deterministic in its name's fields, so when another
        process (a second rank, a second client on this file) recorded the same one first,
        that row stands, provided it describes the same data."""
        self._write((f"INSERT OR IGNORE INTO shuffles ({_columns(ShuffleInfo)}) "
                     f"VALUES ({_placeholders(ShuffleInfo)})", astuple(info)))
        stored = {s.name: s for s in self.shuffles()}[info.name]
        if stored != info:
            raise MdatError(
                f"shuffle {info.name!r} was recorded meanwhile for other data (fingerprint "
                f"{stored.fingerprint}, this one {info.fingerprint}); the container changed "
                "while it was being read: run again.")


def unknown(kind: str, name: str, known: Any) -> UnknownName:
    listing = ", ".join(sorted(known)) or "none yet"
    return UnknownName(f"unknown {kind} {name!r}; the container has: {listing}.")
