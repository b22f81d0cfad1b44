"""The HTTP side under readers that never read (server/http.py, server/blobs.py; issue 47):
one client address is sent at most [server] http_streams_per_client blobs at once (503
beyond), a reader that takes no bytes for http_send_timeout_s is dropped, /status is answered
while they hang, and once they are dropped the server holds no stream of theirs. A real
coordinator serves on loopback; the readers are raw sockets with a small receive buffer."""

from __future__ import annotations

import contextlib
import hashlib
import json
import socket
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator

from support.helpers import served_run_toml
from support.wire import serving_config

from matformer.server.config import RunConfig

STREAMS = 2  # [server] http_streams_per_client here
SEND_TIMEOUT_S = 2.0
WAIT_S = 60.0  # generous: a busy two-core machine runs these
# 2.2M parameters: the universal checkpoint's 9 MB far outlast a 4 KiB receive buffer and
# the loopback socket's send buffer, so the server's own buffer fills and waits
MODEL = {"vocab_size": 260, "hidden_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 1024,
         "max_position_embeddings": 128}


def reader(port: int, path: str, address: str = "127.0.0.1") -> socket.socket:
    """A connection from ``address`` that asks for ``path`` and reads nothing yet."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.bind((address, 0))
    sock.connect(("127.0.0.1", port))
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
    return sock


def status_of(sock: socket.socket) -> int:
    """The status code of the answer on ``sock`` (reading only its first line's bytes)."""
    sock.settimeout(WAIT_S)
    return int(sock.recv(12).split()[1])


def read_all(sock: socket.socket) -> bytes:
    """Everything ``sock`` receives until the server closes or resets it."""
    sock.settimeout(WAIT_S)
    data = []
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(2**16):
            data.append(chunk)
    return b"".join(data)


def until(condition, what: str) -> None:
    give_up = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < give_up, what
        time.sleep(0.02)


@contextlib.contextmanager
def closing_all(socks: list[socket.socket]) -> Iterator[list[socket.socket]]:
    try:
        yield socks
    finally:
        for sock in socks:
            sock.close()


def test_readers_that_never_read_are_capped_then_dropped_while_status_is_answered(tmp_path):
    config = RunConfig.load(served_run_toml(
        tmp_path, min_clients=1, model={"inline": MODEL},
        server={"http_streams_per_client": STREAMS, "http_send_timeout_s": SEND_TIMEOUT_S}))
    with serving_config(config) as (server, _):
        assert server.wait_until_http_ready(WAIT_S)
        store = server.http_server.config.app.state.blobs
        folder = server.coordinator.dir / "checkpoints" / "round-0"
        listed = json.loads((folder / "matformer_manifest.json").read_text())["sha256"]
        name = max(listed, key=lambda n: (folder / n).stat().st_size)
        path, size = f"/blobs/sha256/{listed[name]}", (folder / name).stat().st_size
        base = f"http://127.0.0.1:{server.http_port}"
        with closing_all([reader(server.http_port, path) for _ in range(STREAMS + 2)]) as hung:
            until(lambda: store.streams == Counter({"127.0.0.1": STREAMS}),
                  f"{STREAMS} blobs being sent to 127.0.0.1")
            # the two beyond the cap are refused at once, and their connections closed
            statuses = {sock: status_of(sock) for sock in hung}
            assert sorted(statuses.values()) == [200] * STREAMS + [503] * 2
            sent = [sock for sock, status in statuses.items() if status == 200]
            assert all(read_all(sock).endswith(b"}") for sock in hung if sock not in sent)
            for endpoint in ("/status", "/api/run"):  # answered while the readers hang
                with urllib.request.urlopen(base + endpoint, timeout=WAIT_S) as reply:
                    assert reply.status == 200 and json.loads(reply.read())
            # the cap is per address: another one is sent the whole blob meanwhile
            with closing_all([reader(server.http_port, path, "127.0.0.2")]) as [other]:
                answer = read_all(other)
            head, _, body = answer.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and len(body) == size
            assert hashlib.sha256(body).hexdigest() == listed[name]
            # taking no bytes for SEND_TIMEOUT_S, the readers are dropped: their streams end
            # and the server keeps nothing of them, though they never closed
            until(lambda: not store.streams, "the readers' streams ended")
            assert all(len(read_all(sock)) < size for sock in sent)
