"""One live process at a time in a folder: ``locked`` holds a lock file with the kernel's
``flock``, so the lock goes with the process that held it however that process ended and
is never stale. The file says who holds it, for the refusal a second process gets.

    with locked(state_dir / "client.lock", f"pid {os.getpid()}, name 'laptop'"):
        ...                      # raises FolderInUse(holder) at once if a live process holds it
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; nothing is guarded there
    fcntl = None


class FolderInUse(Exception):
    """A live process holds the lock; ``holder`` is what it wrote in the lock file."""

    def __init__(self, holder: str) -> None:
        super().__init__(holder)
        self.holder = holder


@contextlib.contextmanager
def locked(path: Path, holder: str) -> Iterator[None]:
    """Hold the lock file ``path`` (created with its folder) while the block runs, with
    ``holder`` written in it; FolderInUse at once if another live process holds it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as lock:
        if fcntl is not None:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                lock.seek(0)
                raise FolderInUse(lock.read().strip() or "another process") from None
        lock.seek(0)
        lock.truncate()
        lock.write(holder + "\n")
        lock.flush()
        yield
