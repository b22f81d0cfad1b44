"""What a client keeps in its state dir across restarts, beside its checkpoint cache: the
error feedback of the last accepted round, and the session of its last join. A running
client holds the folder (``held``): two processes sharing it would share a name and a
session and replace each other in the run."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from matformer.client.errors import ClientError
from matformer.modeling.atomic import write_json_atomic
from matformer.modeling.folder_lock import FolderInUse, locked

FEEDBACK_FILE = "error_feedback.safetensors"
# the session token of the last join (0600): a restarted client presents it, so that the
# coordinator lets it take its name back from the member it was
SESSION_FILE = "session.json"
LOCK_FILE = "client.lock"  # locked while a client runs; says its pid and name


class StateDirInUse(ClientError):
    """Another live client process holds this state folder."""


@contextlib.contextmanager
def held(state_dir: Path, name: str) -> Iterator[None]:
    """Hold ``state_dir`` for this process while the block runs, or raise StateDirInUse at
    once if a live process holds it (``modeling.folder_lock``: never stale)."""
    try:
        with locked(state_dir / LOCK_FILE, f"pid {os.getpid()}, name {name!r}"):
            yield
    except FolderInUse as err:
        raise StateDirInUse(
            f"the client state folder {state_dir} is in use by a running client "
            f"({err.holder}); two clients sharing it would share one name and session "
            "and replace each other in the run. Give this one its own: --name "
            "OTHER (its folder follows the name) or --state-dir DIR.") from None


def feedback_path(state_dir: Path) -> Path:
    """Where the error feedback (and inner optimizer state) is saved."""
    state_dir.mkdir(parents=True, exist_ok=True)
    return state_dir / FEEDBACK_FILE


def save_session(state_dir: Path, server: str, token: str) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    write_json_atomic(state_dir / SESSION_FILE, {"server": server, "session_token": token},
                      mode=0o600)


def previous_session(state_dir: Path, server: str) -> str | None:
    """The session token this client held with ``server`` before, if it kept one."""
    try:
        saved = json.loads((state_dir / SESSION_FILE).read_text())
    except (OSError, ValueError):
        return None  # none yet, or unreadable: join as a newcomer
    if not isinstance(saved, dict) or saved.get("server") != server:
        return None
    token = saved.get("session_token")
    return token if isinstance(token, str) and token else None
