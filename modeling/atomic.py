"""Files and folders that appear whole or not at all: the one home of every atomic write.

What is written is built under a hidden sibling name (``.NAME.tmp-XXXXXXXX``), made durable
(every file and folder under it fsynced), then renamed onto the target, and the parent
folder is fsynced so that the rename itself survives a crash. A failed build leaves nothing
behind; a kill during one leaves the sibling, whose name says what it is (a coordinator
removes such leftovers when it starts). A build that fails to write raises ``OSError``,
whatever wrote it: safetensors' own error for a full disk or an I/O error becomes the
``OSError`` it reports, so that every caller handles a failed write one way.

    with built_aside(path) as staging:      # a file or a folder, created by the block
        save_file(tensors, str(staging))
    write_json_atomic(path, data, mode=0o600)
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safetensors import SafetensorError

_ERRNO = re.compile(r"\(os error (\d+)\)")  # how safetensors' messages name an errno


def temporary_sibling(target: Path, kind: str = "tmp") -> Path:
    """A fresh hidden name beside ``target``: ``.NAME.KIND-XXXXXXXX``."""
    return target.with_name(f".{target.name}.{kind}-{uuid.uuid4().hex[:8]}")


@contextmanager
def built_aside(target: Path) -> Iterator[Path]:
    """A fresh sibling path for the block to create a file or folder at; moved onto
    ``target`` when the block succeeds. ``target`` may be missing, a file or a folder (a
    folder is replaced whole: the old one is moved aside first and removed after)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    building = temporary_sibling(target)
    try:
        with _write_errors(target):
            yield building
        fsync_tree(building)
        if target.is_dir() and not target.is_symlink():
            retired = temporary_sibling(target, "old")
            target.rename(retired)
            building.rename(target)
            shutil.rmtree(retired)
        else:
            os.replace(building, target)
    finally:
        _remove(building)
    fsync_path(target.parent)


@contextmanager
def merged_aside(target: Path, last: str | None = None) -> Iterator[Path]:
    """A fresh sibling folder for the block to fill; each entry of it then replaces its
    namesake in the folder ``target`` (``last`` moved last), and whatever else ``target``
    holds stays: a run's folder keeps its checkpoints and logs when its model is written.
    Each entry appears whole; a missing ``target`` appears whole, as with ``built_aside``."""
    target = Path(target)
    if not target.is_dir():
        with built_aside(target) as building:
            yield building
        return
    building = temporary_sibling(target)
    try:
        with _write_errors(target):
            yield building
        fsync_tree(building)
        for entry in sorted(building.iterdir(), key=lambda p: p.name == last):
            _remove(target / entry.name)
            entry.rename(target / entry.name)
        fsync_path(target)
    finally:
        _remove(building)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def _write_errors(target: Path) -> Iterator[None]:
    """safetensors writes through its own I/O and error type: its failed write becomes the
    ``OSError`` it reports."""
    try:
        yield
    except SafetensorError as err:
        failed = _os_error(err, target)
        if failed is None:
            raise
        raise failed from err


def _os_error(err: SafetensorError, target: Path) -> OSError | None:
    """The OSError behind a failed safetensors write (a full disk: ENOSPC; EIO where its
    message names no errno), or None when the failure was none of the file system's."""
    text = str(err)
    if "I/O error" not in text:
        return None
    found = _ERRNO.search(text)
    if found is None:
        return OSError(errno.EIO, text, str(target))
    code = int(found.group(1))
    return OSError(code, os.strerror(code), str(target))


def write_json_atomic(path: Path, data: dict[str, Any], *, mode: int = 0o644,
                      compact: bool = False) -> None:
    """``data`` as JSON at ``path``, whole or not at all. ``mode`` is the file's (its
    temporary file is created with it, so a private file is never readable by others, not
    even while written); NaN and infinities are refused (ValueError): JSON has no such
    numbers, and a reader would take them as text. ``compact``: on one line, for the files
    a run writes every round (indenting runs Python's own encoder, 10-50 times slower than
    the C one, which at a thousand members was a second of every round)."""
    text = json.dumps(data, indent=None if compact else 2, allow_nan=False) + "\n"
    with built_aside(Path(path)) as staging:
        descriptor = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(descriptor, "w") as handle:
            handle.write(text)


def fsync_tree(path: Path) -> None:
    """Flush a file, or a folder and everything under it, to disk (before a rename)."""
    if path.is_dir():
        for child in path.iterdir():
            fsync_tree(child)
    fsync_path(path)


def fsync_path(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
