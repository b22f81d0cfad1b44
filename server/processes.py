"""What the coordinator's child processes (its close shards, its heartbeat process) share."""

from __future__ import annotations

import contextlib
import ctypes
import signal


def die_with_parent() -> None:
    """Linux: this process is killed when its parent is (a child left behind would hold its
    port, or wait for commands forever). Elsewhere nothing happens."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
