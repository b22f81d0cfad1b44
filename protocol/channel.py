"""What both ends of a coordinator connection must agree on beyond the ``.proto``.

Streams carry parameters in batches of about ``BATCH_BYTES`` (``batched``): a small
model's submission or update is one message, a large one's a few, where one message per
parameter cost the coordinator a fraction of a millisecond each, per member and round. One
parameter alone can exceed gRPC's 4 MiB default (a dense result of a large embedding, say),
so both ends raise the limit to ``MAX_MESSAGE_BYTES``: ``grpc.server(executor,
options=GRPC_OPTIONS)`` and ``open_channel(target)``, which also takes the certificate to
trust for TLS.

    channel = open_channel("root.example:7070", tls_ca=Path("ca.pem"))  # None: plaintext
    port = listen(server, "0.0.0.0:7170", cert=cert, key=key)          # None, None: plaintext
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import grpc

from matformer.protocol.matformer.v1 import coordinator_pb2 as pb

M = TypeVar("M")
COORDINATOR_SERVICE: str = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# A batch of parameters closes once it holds this many bytes: few messages, and none so large
# that a stream's watch (server/call_slots.py) waits long for it on a slow link.
BATCH_BYTES = 1024 * 1024
GRPC_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)
# A client's channel tries to reconnect at least this often. gRPC's own backoff grows to 120 s,
# so a coordinator back after a minute's outage went unanswered for 12 s more, and after a
# longer one for up to two minutes; the client retries calls with its own backoff anyway.
RECONNECT_MAX_MS = 2000
CLIENT_OPTIONS = (*GRPC_OPTIONS, ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS))


def batched(items: Iterable[M], size: Callable[[M], int], limit: int = BATCH_BYTES
            ) -> Iterator[list[M]]:
    """``items`` in order, in lists of at least one item that stop growing once their
    ``size`` reaches ``limit`` (an item larger than ``limit`` travels alone)."""
    batch: list[M] = []
    held = 0
    for item in items:
        batch.append(item)
        held += size(item)
        if held >= limit:
            yield batch
            batch, held = [], 0
    if batch:
        yield batch


def open_channel(address: str, *, tls_ca: Path | None = None,
                 options: tuple[tuple[str, int], ...] = CLIENT_OPTIONS) -> grpc.Channel:
    """A channel to a coordinator (or a relay) at ``address``: TLS trusting the PEM
    certificate ``tls_ca`` when given, else plaintext."""
    if tls_ca is None:
        return grpc.insecure_channel(address, options=options)
    credentials = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes())
    return grpc.secure_channel(address, credentials, options=options)


def at_port(address: str, port: int) -> str:
    """``address`` ("host:port", "[v6]:port") with its port replaced by ``port``: another
    server of the same host (the coordinator's heartbeat process)."""
    host, colon, _ = address.rpartition(":")
    if not colon:
        raise ValueError(f"{address!r} has no port; give the address as host:port.")
    return f"{host}:{port}"


def listen(server: grpc.Server, address: str, *, cert: Path | None = None,
           key: Path | None = None) -> int:
    """Bind ``server`` to ``address``: TLS with the PEM certificate chain ``cert`` and its
    private ``key`` when given, else plaintext. Returns the port bound (``address`` may ask
    for port 0); RuntimeError when the port is taken."""
    if cert is None or key is None:
        return server.add_insecure_port(address)
    credentials = grpc.ssl_server_credentials([(Path(key).read_bytes(), Path(cert).read_bytes())])
    return server.add_secure_port(address, credentials)


def is_loopback(host: str) -> bool:
    """Whether ``host`` reaches this machine only (a loopback address, or "localhost")."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return host == "localhost"
