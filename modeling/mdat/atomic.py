"""Writing a file or a folder so that it appears whole or not at all.

The content is built under a unique hidden sibling name, made durable (every file and folder
fsynced), then renamed onto the target, and the parent folder is fsynced so the rename itself
survives a crash. A catalogue row written after `built_aside` returns can therefore trust the
files it describes. A failed build leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def built_aside(target: Path) -> Iterator[Path]:
    """A fresh sibling path to create a file or folder at; moved onto ``target`` on success.

    ``target`` may be missing, a file (replaced) or an empty folder (replaced); a non-empty
    folder in the way raises ``OSError``, so callers remove what they mean to replace.
    """
    building = target.with_name(f".{target.name}.{uuid.uuid4().hex}.building")
    try:
        yield building
        fsync_tree(building)
        os.replace(building, target)
    except BaseException:
        if building.is_dir():
            shutil.rmtree(building, ignore_errors=True)
        else:
            building.unlink(missing_ok=True)
        raise
    fsync_path(target.parent)


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
