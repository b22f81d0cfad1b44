"""Join and session tokens (docs/architecture.md, "Transport").

``Join`` carries the run's join token in its request. Every other RPC carries the session
token ``Join`` issued as the gRPC metadata entry ``SESSION_METADATA_KEY``: metadata reaches
unary and streaming calls alike without a field in every message, and a client sets it once
with ``with_session(channel, token)``. A session token is ``"<client id>.<secret>"``, so the
coordinator looks up the client's token by id and compares the whole token in constant time.
It keeps only each token's sha256 (``"sha256:<hex>"``), so the file the tokens are saved in
does not let its reader act as a member.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from collections import namedtuple
from collections.abc import Callable, Mapping
from typing import NoReturn

import grpc

SESSION_METADATA_KEY = "matformer-session-token"
TOKEN_HASH = "sha256:"  # the prefix of a stored token hash; anything else is a clear token


def tokens_equal(presented: str, expected: str) -> bool:
    """Constant-time comparison, so timing reveals nothing about ``expected``."""
    return hmac.compare_digest(presented.encode(), expected.encode())


def new_join_token() -> str:
    """A fresh random join token for a run's config."""
    return secrets.token_urlsafe(32)


def token_hash(token: str) -> str:
    """What ``SessionTokens`` keeps of a token: ``"sha256:<hex>"``. A token holds 256 random
    bits, so a plain hash cannot be reversed by guessing."""
    return TOKEN_HASH + hashlib.sha256(token.encode()).hexdigest()


class SessionTokens:
    """The coordinator's session tokens by client id, as hashes; safe to use from gRPC's
    worker threads."""

    def __init__(self, tokens: Mapping[str, str] | None = None) -> None:
        # client id → token hash, e.g. restored from state.json; one saved before tokens were
        # hashed holds them in clear, and they are hashed here
        self._hashes = {client_id: stored if stored.startswith(TOKEN_HASH) else token_hash(stored)
                        for client_id, stored in (tokens or {}).items()}
        self._lock = threading.Lock()
        # told of each change, (client id, its token's hash or None once revoked), before the
        # call making it returns: how a copy elsewhere (server/heartbeats.py) keeps up
        self.on_change: Callable[[str, str | None], None] | None = None

    def issue(self, client_id: str) -> str:
        """A new token for ``client_id``; any earlier one stops working."""
        token = f"{client_id}.{secrets.token_urlsafe(32)}"
        hashed = token_hash(token)
        with self._lock:
            self._hashes[client_id] = hashed
        if self.on_change is not None:
            self.on_change(client_id, hashed)
        return token

    def client_of(self, token: str) -> str | None:
        """The client id ``token`` belongs to, or None for an unknown or revoked token."""
        client_id = token.rpartition(".")[0]  # the secret is URL-safe base64: it has no "."
        with self._lock:
            expected = self._hashes.get(client_id)
        matches = expected is not None and tokens_equal(token_hash(token), expected)
        return client_id if matches else None

    def revoke(self, client_id: str) -> None:
        with self._lock:
            self._hashes.pop(client_id, None)
        if self.on_change is not None:
            self.on_change(client_id, None)

    def holds(self, client_id: str) -> bool:
        """Whether ``client_id`` has a token now."""
        with self._lock:
            return client_id in self._hashes

    def mirror(self, changes: Mapping[str, str | None]) -> None:
        """Take another ``SessionTokens``' changes: client id → token hash, None: revoked."""
        with self._lock:
            for client_id, hashed in changes.items():
                if hashed is None:
                    self._hashes.pop(client_id, None)
                else:
                    self._hashes[client_id] = hashed

    def as_dict(self) -> dict[str, str]:
        """Client id → token hash: what ``SessionTokens(...)`` restores from."""
        with self._lock:
            return dict(self._hashes)


def check_join_token(context: grpc.ServicerContext, presented: str, expected: str) -> None:
    """Abort the call with UNAUTHENTICATED unless ``presented`` is the run's join token."""
    if not tokens_equal(presented, expected):
        context.abort(grpc.StatusCode.UNAUTHENTICATED,
                      "wrong join token; ask the run's operator for it (--join-token).")


def presented_session(context: grpc.ServicerContext) -> str:
    """The session token the call carries; aborts with UNAUTHENTICATED when it carries none."""
    token = dict(context.invocation_metadata()).get(SESSION_METADATA_KEY)
    if not token:
        _abort(context, f"no session token; call Join and send the token it returns as "
                        f"'{SESSION_METADATA_KEY}' metadata.")
    return token


def require_session(context: grpc.ServicerContext, sessions: SessionTokens) -> str:
    """The calling client's id; aborts with UNAUTHENTICATED if its session token is missing,
    unknown or revoked."""
    client_id = sessions.client_of(presented_session(context))
    if client_id is None:
        _abort(context, "unknown or revoked session token; call Join again.")
    return client_id


def session_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The ``metadata=`` argument that authenticates one call."""
    return ((SESSION_METADATA_KEY, token),)


def with_session(channel: grpc.Channel, token: str) -> grpc.Channel:
    """A channel that sends ``token`` on every call made through it."""
    return grpc.intercept_channel(channel, _SessionInterceptor(token))


def _abort(context: grpc.ServicerContext, message: str) -> NoReturn:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
    raise AssertionError("unreachable: context.abort raises")


class _CallDetails(
    namedtuple("_CallDetails",
               ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
    grpc.ClientCallDetails,
):
    """grpc.ClientCallDetails is an abstract interface; interceptors supply their own."""


class _SessionInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                          grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self._metadata = session_metadata(token)

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        return _CallDetails(details.method, details.timeout,
                            (*(details.metadata or ()), *self._metadata), details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._with_token(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._with_token(details), requests)
