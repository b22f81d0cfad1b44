"""What a client keeps in its state dir across restarts, beside its checkpoint cache: the
error feedback of the last accepted round, and the session of its last join."""

from __future__ import annotations

import json
from pathlib import Path

from modeling.atomic import write_json_atomic

FEEDBACK_FILE = "error_feedback.safetensors"
# the session token of the last join (0600): a restarted client presents it, so that the
# coordinator lets it take its name back from the member it was
SESSION_FILE = "session.json"


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
