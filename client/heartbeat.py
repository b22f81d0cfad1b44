"""Heartbeats beside a long piece of work (``Connection.keep_alive``).

They come from a thread of their own that only sleeps and sends: the training's threads
release the GIL in every tensor operation, and Python hands it over every few
milliseconds otherwise, so a busy member still beats on time. Each connection runs one
heartbeat thread at most: a ``keep_alive`` inside another adds none. The longest time
between two beats sent is kept (``Connection.heartbeat_gap_s``), for the member's summary: a
figure near the run's ``heartbeat_timeout_s`` says the timeout is tight for this machine."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from matformer.client.errors import Refused, Unreachable

if TYPE_CHECKING:
    from matformer.client.connection import Connection


class Heartbeat:
    """Heartbeats every ``connection.heartbeat_s`` on a background thread while a ``with``
    block runs (loading, a round's training), so the coordinator tells a busy client from a
    hung one. Failures are the coordinator's to notice (a missed heartbeat); the thread only
    logs the first one."""

    def __init__(self, connection: Connection, round_index: Callable[[], int]) -> None:
        self.connection = connection
        self.interval_s = connection.heartbeat_s
        self.round_index = round_index
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="matformer-heartbeat",
                                        daemon=True)

    def __enter__(self) -> Heartbeat:
        if self.interval_s > 0 and self.connection.heartbeats is None:
            self.connection.heartbeats = self
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.connection.heartbeats is not self:
            return  # an outer keep_alive's thread goes on beating
        self.connection.heartbeats = None
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)

    def _beat(self) -> None:
        warned = False
        last = time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            self.connection.heartbeat_gap_s = max(self.connection.heartbeat_gap_s, now - last)
            last = now
            try:
                self.connection.heartbeat(self.round_index(), patience_s=self.interval_s)
            except (Refused, Unreachable) as err:
                if not warned:
                    self.connection.log(f"heartbeat failed: {err}")
                    warned = True
