"""Client keys: one credential per member, issued by the operator (``[auth] mode = "keys"``).

A shared join token admits anyone who has it under any name, so nothing about a member
outlives its session. A client key names its holder: the operator issues it with
``matformer-server keys add NAME --config run.toml``, hands the printed key to that person
once, and the client presents it where a join token goes (``--join-token`` or
``$MATFORMER_JOIN_TOKEN``). The member then joins under the key's name whatever name it
reports, a second join with the key takes over from the first (a restarted machine), and an
exclusion holds the key, not a name anyone could type.

A key is ``"<name>.<secret>"``: the name finds the entry, the whole key is compared in
constant time with its stored sha256, and the file (mode 0600) keeps only that hash, so a
reader of the file cannot act as a member. The coordinator reads the file at every Join, so
keys added or removed while it runs take effect at once.

    keys = KeyFile(path)
    key = keys.add("alice")                  # printed once; the file keeps its hash
    keys.holder(key)                         # -> KeyHolder(name="alice", key_hash="sha256:...")
    keys.remove("alice")
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matformer.modeling.atomic import write_json_atomic
from matformer.protocol.auth import token_hash, tokens_equal
from matformer.server.errors import ServerError
from matformer.server.tiers import valid_name

KEYS_VERSION = 1
SECRET_BYTES = 32  # of a key's secret: 43 URL-safe base64 characters


class KeyFileError(ServerError):
    """The keys file is unreadable, or an operator's keys command cannot be done as asked."""


@dataclass(frozen=True, slots=True)
class KeyHolder:
    name: str  # the member name the key carries
    key_hash: str  # "sha256:<hex>": what an exclusion is bound to
    relay: bool = False  # issued with --relay: it admits a relay, and only a relay


class KeyFile:
    """The keys file at ``path``: name → the key's hash and when it was issued."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    def add(self, name: str, *, relay: bool = False) -> str:
        """Issue a key for ``name`` and return it (the only time it is seen in clear);
        ``relay``: the key admits a relay (``matformer relay --relay-token``), not a
        member."""
        if not valid_name(name):
            raise KeyFileError(f"key name {name[:64]!r} is not 1-64 letters, digits or "
                               ". _ @ + -, starting with a letter or digit; choose another.")
        entries = self.entries()
        if name in entries:
            raise KeyFileError(f"{self.path} already holds a key named {name!r}; "
                               f"`keys remove {name}` first to issue a new one.")
        key = f"{name}.{secrets.token_urlsafe(SECRET_BYTES)}"
        entries[name] = {"hash": token_hash(key), "issued": time.time(),
                         **({"role": "relay"} if relay else {})}
        self._write(entries)
        return key

    def remove(self, name: str) -> None:
        entries = self.entries()
        if name not in entries:
            raise KeyFileError(f"{self.path} holds no key named {name!r}; `keys list` shows "
                               "the names it holds.")
        del entries[name]
        self._write(entries)

    def holder(self, key: str) -> KeyHolder | None:
        """Whose key ``key`` is, or None for a key this file does not hold."""
        name = key.rpartition(".")[0]  # the secret is URL-safe base64: it has no "."
        entry = self.entries().get(name)
        if entry is None or not tokens_equal(token_hash(key), entry["hash"]):
            return None
        return KeyHolder(name=name, key_hash=entry["hash"], relay=entry.get("role") == "relay")

    def entries(self) -> dict[str, dict[str, Any]]:
        """Name → {"hash", "issued"} (and "role": "relay" for a relay's key); empty when the
        file does not exist yet."""
        if not self.path.exists():
            return {}
        try:
            data = json.loads(self.path.read_text())
            entries = data["keys"]
            if data.get("version") != KEYS_VERSION or not all(
                    isinstance(e, dict) and str(e.get("hash", "")).startswith("sha256:")
                    and e.get("role", "member") in ("member", "relay")
                    for e in entries.values()):
                raise ValueError("unexpected layout")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise KeyFileError(f"the keys file {self.path} cannot be read ({err}); restore it "
                               "or remove it and issue the keys again.") from err
        return entries

    def _write(self, entries: dict[str, dict[str, Any]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, {"version": KEYS_VERSION, "keys": entries}, mode=0o600)
