"""[server], [auth] and [tls]: where the servers listen, who may join and who may change
the run, and the certificate both servers present."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from matformer.modeling.settings import setting
from matformer.protocol.auth import tokens_equal
from matformer.server.errors import (
    ConflictingKeys,
    InvalidValue,
    MissingFile,
    MissingKey,
    MissingSecret,
)
from matformer.server.sections.checks import MAX_SECONDS, SECONDS, require

# What each [auth] mode asks of a joining client (an unknown mode's error lists them)
AUTH_MODES = {
    "token": "clients present the join token",
    "keys": "clients present keys issued with `matformer-server keys add NAME`",
    "none": "no join token, and the server listens on loopback only",
}


@dataclass(kw_only=True, slots=True)
class ServerSection:
    host: str = setting("127.0.0.1", help=(
        "address both servers bind; \"0.0.0.0\" accepts clients from other machines"))
    grpc_port: int = setting(7070, low=1, high=65535, help="the coordinator service (clients)")
    http_port: int = setting(7071, low=1, high=65535, help=(
        "status, dashboard, metrics and checkpoint files"))
    # server/heartbeats.py: beats answered where the round's work does not run
    heartbeat_port: int | None = setting(None, low=0, high=65535, help=(
        "answer heartbeats in a process of their own on this port (0: any free one), so "
        "that a thousand members' beats never wait behind the close or the uploads; unset: "
        "on grpc_port with every other call"))
    # false exits once the members have left (server/run_end.py)
    stay_after_finish: bool = setting(False, help=(
        "once the run is finished, keep the dashboard and checkpoint files served until "
        "Ctrl-C"))
    # What HTTP clients may hold of the server (server/http.py): a reader that never reads
    # holds its connection and what is buffered for it until the send timeout drops it.
    http_connections: int = setting(512, low=1, high=100_000, help=(
        "HTTP connections and requests at once; beyond them, 503"))
    http_streams_per_client: int = setting(16, low=1, high=100_000, help=(
        "blobs (/blobs/sha256/...) sent at once to one client address; beyond them, 503"))
    http_send_timeout_s: float = setting(10.0, low=0, above=True, high=MAX_SECONDS,
                                         unit=SECONDS, help=(
        "an HTTP answer whose client takes none of its bytes for this long is dropped"))

    def __post_init__(self) -> None:
        require(bool(self.host), "[server] host is empty; give an address such as 127.0.0.1.")
        require(self.grpc_port != self.http_port,
                f"[server] grpc_port and http_port are both {self.grpc_port}; give each its own "
                "port.")
        require(self.heartbeat_port in (None, 0)
                or self.heartbeat_port not in (self.grpc_port, self.http_port),
                f"[server] heartbeat_port is {self.heartbeat_port}, a port another server "
                "of the coordinator binds; give it its own port (or 0: any free one).")


@dataclass(kw_only=True, slots=True)
class AuthSection:
    """Who may join and who may change the run. Each token is written here or (better) read
    from an environment variable. ``mode = "keys"`` admits only holders of a client key the
    operator issued (``matformer-server keys add NAME``; server/keys.py), each under its key's
    name. ``mode = "none"`` admits any client without a join token, and the server then
    listens on loopback only, whatever [server] host says.

    A relay speaks for its members (their losses, their results summed), so the role is
    granted, never taken: under mode = "token" a relay presents the relay token, under
    mode = "keys" a key issued with ``--relay``; a member's credential does not admit a
    relay, nor a relay's a member (``joins.credentials``)."""

    mode: str = setting("token", choices=AUTH_MODES, help="who may join; " + "; ".join(
        f"{mode}: {meaning}" for mode, meaning in AUTH_MODES.items()))
    join_token: str | None = setting(None, secret=True, help=(
        "the join token itself (then keep this file private)"))
    join_token_env: str | None = setting(None, help=(
        "name of the environment variable holding the join token"))
    relay_token: str | None = setting(None, secret=True, help=(
        "mode = \"token\": the token a relay presents (matformer relay --relay-token); "
        "unset: no relay may join (mode = \"keys\": keys add NAME --relay)"))
    relay_token_env: str | None = setting(None, help=(
        "name of the environment variable holding the relay token"))
    operator_token: str | None = setting(None, secret=True, help=(
        "the token HTTP writes (POST /api/...) need; unset: HTTP is read-only"))
    operator_token_env: str | None = setting(None, help=(
        "name of the environment variable holding the operator token"))
    keys_file: Path | None = setting(None, help=(
        "mode = \"keys\": the client keys; unset: keys.json in [run] dir"))

    def __post_init__(self) -> None:
        for key in ("join_token", "relay_token", "operator_token"):
            if getattr(self, key) is not None and getattr(self, f"{key}_env") is not None:
                raise ConflictingKeys(f"[auth] gives both {key} and {key}_env; keep one.")
            require(getattr(self, key) != "", f"[auth] {key} is empty; set a token.")
        join_keys = [k for k in ("join_token", "join_token_env") if getattr(self, k) is not None]
        if self.mode != "token" and join_keys:
            raise ConflictingKeys(f"[auth] mode = \"{self.mode}\" admits clients without the "
                                  f"join token, but {join_keys[0]} is given; remove it, or set "
                                  "mode = \"token\" to require the token.")
        relay_keys = [k for k in ("relay_token", "relay_token_env")
                      if getattr(self, k) is not None]
        if self.mode != "token" and relay_keys:
            grant = ("issue the relay a key with `matformer-server keys add NAME --relay`"
                     if self.mode == "keys" else "any relay on this machine may join")
            raise ConflictingKeys(f"[auth] {relay_keys[0]} is given but mode = \"{self.mode}\" "
                                  f"does not read it: {grant}; remove it.")
        if self.mode != "keys" and self.keys_file is not None:
            raise ConflictingKeys(f"[auth] keys_file is given but mode = \"{self.mode}\" does "
                                  "not read it; set mode = \"keys\" or remove keys_file.")
        if self.mode == "token" and not join_keys:
            raise MissingKey("[auth] needs join_token_env (the name of an environment variable "
                             "holding the join token) or join_token; "
                             "python -c 'from protocol.auth import new_join_token as t; "
                             "print(t())' makes one. (mode = \"none\" runs without one, on "
                             "loopback only.)")
        if self.mode == "token":
            token, relay = self.token(), self.relay()
            require(relay is None or not tokens_equal(relay, token),
                    "[auth] the relay token is the join token, so every member could join as "
                    "a relay; give relays a token of their own.")
        self.operator()

    def token(self) -> str:
        """The join token, read from the environment now when ``join_token_env`` names it."""
        if self.mode != "token":  # callers check the mode first; never compare against nothing
            raise InvalidValue(f"[auth] mode = \"{self.mode}\" has no join token.")
        return self._secret("join_token")

    def relay(self) -> str | None:
        """The relay token (read from the environment now when ``relay_token_env`` names
        it), or None when mode = "token" grants no relay role."""
        return self._secret("relay_token") if self.mode == "token" else None

    def operator(self) -> str | None:
        """The operator token (read from the environment now when ``operator_token_env`` names
        it), or None when the run has none and its HTTP side is read-only."""
        return self._secret("operator_token")

    def _secret(self, key: str) -> str | None:
        env = getattr(self, f"{key}_env")
        if env is None:
            return getattr(self, key)
        token = os.environ.get(env, "")
        if not token:
            raise MissingSecret(f"[auth] {key}_env names ${env}, which is unset or empty; "
                                "export it before starting the server.")
        return token


@dataclass(kw_only=True, slots=True)
class TlsSection:
    """TLS for the gRPC and HTTP servers (one certificate for both): both files or neither
    (then plaintext, for loopback runs)."""

    cert: Path | None = setting(None, help="PEM certificate chain")
    key: Path | None = setting(None, help="PEM private key")

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            given, absent = ("cert", "key") if self.key is None else ("key", "cert")
            raise MissingKey(f"[tls] gives {given} but not {absent}; give both or neither.")
        for key in ("cert", "key"):
            path = getattr(self, key)
            if path is not None and not path.is_file():
                raise MissingFile(f"[tls] {key} {path} does not exist; fix the path.")

    @property
    def enabled(self) -> bool:
        return self.cert is not None
