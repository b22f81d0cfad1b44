"""A small HTTP server on loopback for tests that stand up a mirror or cache of the
coordinator's HTTP side: ``answer(path)`` gives each GET's status and body."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Callable, Iterator


@contextlib.contextmanager
def serving_http(answer: Callable[[str], tuple[int, bytes]]) -> Iterator[str]:
    """``answer`` served on a free loopback port until the block ends; its base URL."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = answer(self.path)
            with contextlib.suppress(OSError):  # the client gave up on a slow answer
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10.0)
