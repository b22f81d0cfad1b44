"""client.heartbeat: one heartbeat thread per connection, beating beside busy work."""

from __future__ import annotations

import threading
import time

import torch

from matformer.client.heartbeat import Heartbeat

INTERVAL_S = 0.05


class Beats:
    """What Heartbeat needs of a Connection; counts the heartbeats and their threads."""

    def __init__(self) -> None:
        self.heartbeat_s = INTERVAL_S
        self.heartbeats = None
        self.heartbeat_gap_s = 0.0
        self.rounds: list[int] = []
        self.threads: set[int] = set()

    def heartbeat(self, round_index: int, patience_s: float | None = None) -> None:
        self.rounds.append(round_index)
        self.threads.add(threading.get_ident())

    def keep_alive(self, round_index):
        return Heartbeat(self, round_index)

    def log(self, text: str) -> None:
        raise AssertionError(text)


def beating() -> int:
    return sum(t.name == "matformer-heartbeat" for t in threading.enumerate())


def test_a_keep_alive_inside_another_adds_no_thread_and_the_outer_goes_on():
    conn = Beats()
    with conn.keep_alive(lambda: 1):
        with conn.keep_alive(lambda: 2):
            assert beating() == 1
            time.sleep(4 * INTERVAL_S)
        assert beating() == 1 and conn.heartbeats is not None  # the outer one still beats
        count = len(conn.rounds)
        while len(conn.rounds) == count:
            time.sleep(INTERVAL_S / 5)
    assert beating() == 0 and conn.heartbeats is None
    assert set(conn.rounds) == {1} and len(conn.threads) == 1
    assert conn.heartbeat_gap_s >= INTERVAL_S


def test_heartbeats_go_on_while_the_main_thread_computes():
    conn = Beats()
    x = torch.randn(256, 256)
    with conn.keep_alive(lambda: 0):
        deadline = time.monotonic() + 40 * INTERVAL_S
        while time.monotonic() < deadline:  # tensor work and a pure-Python loop, no sleeps
            x = torch.tanh(x @ x)
            sum(i * i for i in range(20_000))
    assert len(conn.rounds) >= 2  # 40 intervals of busy work: beats came, not none
