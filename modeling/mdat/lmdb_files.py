"""A submdat's LMDB files: shared opening, growth, and damage surfacing as `MdatCorrupt`.

LMDB allows one open environment per file per process, so every reader and writer of a
file in this process shares one environment, counted by `acquire` / `release` and closed
when the last user lets go. Environments do not survive ``fork``: pretokenization's worker
processes are forked, so they never touch LMDB; this process reads the documents and sends
them to the workers (`modeling.mdat.pretok_workers`).

LMDB memory-maps its file: reading a page past the end of a truncated file kills the process
with SIGBUS instead of raising. So every `acquire` compares the file's size with the last
page LMDB's meta page says is in use, and refuses a file that is too short.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import lmdb

from matformer.modeling.errors import MdatCorrupt

# The first map; writers double it whenever a transaction finds it full (`grow`).
INITIAL_MAP_SIZE = 256 << 20


def document_key(index: int) -> bytes:
    """Big-endian, so LMDB's byte order of keys is the documents' order."""
    return struct.pack(">Q", index)


def damaged(path: Path, err: Exception) -> MdatCorrupt:
    return MdatCorrupt(
        f"{path} is damaged or missing ({err}). Its documents cannot be read: copy the file "
        "back from a backup, or import the source again into a new container."
    )


@dataclass(slots=True)
class _Shared:
    env: lmdb.Environment
    identity: tuple[int, int]  # (st_dev, st_ino): a replaced file is a different file
    users: int


_open: dict[Path, _Shared] = {}


def acquire(path: Path, *, create: bool = False) -> lmdb.Environment:
    """This process's environment on the single file ``path`` (created when ``create``)."""
    path = path.resolve()
    shared = _open.get(path)
    if shared is not None and shared.identity != _identity(path):
        shared.env.close()  # its file was deleted or replaced under it
        del _open[path]
        shared = None
    if shared is None:
        shared = _Shared(_open_env(path, create), _identity(path), 0)
    try:
        _check_size(path, shared.env)
    except MdatCorrupt:
        if shared.users == 0:  # opened just now, not shared yet: close it again
            shared.env.close()
        raise
    _open[path] = shared
    shared.users += 1
    return shared.env


def release(env: lmdb.Environment) -> None:
    """Let go of an environment from `acquire`; the last user's release closes it."""
    path = Path(env.path()).resolve()
    shared = _open.get(path)
    if shared is None or shared.env is not env:
        return  # closed already, because its file was replaced
    shared.users -= 1
    if shared.users == 0:
        env.close()
        del _open[path]


def grow(env: lmdb.Environment) -> None:
    """Double the map after `lmdb.MapFullError` (no transaction may be open)."""
    env.set_mapsize(2 * env.info()["map_size"])


def _identity(path: Path) -> tuple[int, int]:
    try:
        status = path.stat()
    except OSError:
        return (0, 0)
    return (status.st_dev, status.st_ino)


def _open_env(path: Path, create: bool) -> lmdb.Environment:
    if not create and not path.is_file():
        raise damaged(path, FileNotFoundError("no such file"))
    writable = create or os.access(path, os.W_OK)
    size = path.stat().st_size if path.exists() else 0
    if path.exists() and size < 2 * mmap.PAGESIZE:  # not even LMDB's two meta pages
        raise damaged(path, EOFError(f"file is only {size} bytes"))
    try:
        return lmdb.open(
            str(path), subdir=False, map_size=max(INITIAL_MAP_SIZE, size), readonly=not writable,
            lock=writable, readahead=False, create=create,
        )
    except lmdb.Error as err:
        raise damaged(path, err) from err


def _check_size(path: Path, env: lmdb.Environment) -> None:
    size = path.stat().st_size
    if size < 2 * mmap.PAGESIZE:
        raise damaged(path, EOFError(f"file is only {size} bytes"))
    try:
        used = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
    except lmdb.Error as err:
        raise damaged(path, err) from err
    if size < used:
        raise damaged(path, EOFError(f"file is {size} bytes, LMDB uses {used}"))
