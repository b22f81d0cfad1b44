"""Heartbeats beside a long piece of work (``Connection.keep_alive``)."""

from __future__ import annotations

import threading
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
        if self.interval_s > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)

    def _beat(self) -> None:
        warned = False
        while not self._stop.wait(self.interval_s):
            try:
                self.connection.heartbeat(self.round_index(), patience_s=self.interval_s)
            except (Refused, Unreachable) as err:
                if not warned:
                    self.connection.log(f"heartbeat failed: {err}")
                    warned = True
