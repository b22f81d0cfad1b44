"""What the dashboard's polling costs a coordinator as its run grows: is the page's
incremental poll flat in the run's length, and how long does each poll hold the coordinator's
lock (which the gRPC threads wait on)?

One process starts a real ``matformer-server`` (``RunningServer.start`` on loopback, ports 0)
on a tiny model, with three members joined over gRPC. For each history length (rounds), the
run's state is filled with that many round records, loss points per tier and events, shaped
like those a real run writes (``Coordinator._record_round``, ``RunHistory.loss`` and
``RunHistory.event``). Then, over real HTTP, each of these is fetched ``--polls`` times,
interleaved, and the median is shown:

- ``page poll``: what the dashboard asks each second once it has the history:
  ``/api/dashboard?since_round=<last>&events_after=<last>`` (members, the newest round);
- ``first load``: the page's first ``/api/dashboard`` (the whole history);
- ``/metrics``: the reference, the smallest answer the HTTP side gives.

``lock ms`` is ``Coordinator.snapshot`` timed directly: the part of a poll that blocks the
coordinator. The page poll over the reference should stay flat as rounds grow.

    python bench/status_api.py                         # 150, 1,000 and 10,000 rounds (~20 s)
    python bench/status_api.py --rounds 100,100000 --polls 20
    python bench/status_api.py --smoke                 # 20 and 200 rounds, 2 polls: it runs
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
from harness import parse, print_table

from matformer.protocol.channel import GRPC_OPTIONS
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.server.config import RunConfig
from matformer.server.history import MAX_EVENTS
from matformer.server.main import RunningServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.helpers import served_run_toml
from support.wire import join_request

TIERS = (0, 1, 2)
SMOKE = dict(rounds="20,200", polls=2)


def fill(coordinator, rounds: int) -> None:
    """A history of ``rounds`` rounds, shaped like a real run's."""
    state = coordinator.state
    state.rounds = [{
        "round": r, "opened_at": 1e9 + 3 * r, "closed_at": 1e9 + 3 * r + 2.5,
        "duration_s": 2.5, "tokens": 4096, "clients": 3, "slowest_client_id": "client-2",
        "slowest_name": "laptop", "slowest_s": 2.4, "bytes_sent": 95_000,
        "bytes_dense": 4_200_000,
        "dropped": [{"client_id": "client-1", "name": "desk", "reason": "silent for 12 s"}]
        if r % 50 == 0 else []} for r in range(rounds)]
    state.loss = {str(t): [[r, 5.5 - r / max(rounds, 1)] for r in range(rounds)] for t in TIERS}
    state.events = [{"seq": i, "time": 1e9 + i, "round": i % max(rounds, 1), "kind": "drop",
                     "client_id": "client-1", "detail": "missed the round deadline (30 s)"}
                    for i in range(min(rounds, MAX_EVENTS))]
    state.round = rounds


def fetch(url: str) -> int:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return len(reply.read())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", default="150,1000,10000",
                        help="history lengths (comma-separated)")
    parser.add_argument("--polls", type=int, default=15, help="fetches of each, interleaved")
    args = parse(parser, SMOKE, argv)
    lengths = [int(n) for n in args.rounds.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        toml = served_run_toml(Path(folder), min_clients=4)  # 3 join: no round opens
        server = RunningServer.start(RunConfig.load(toml), grpc_port=0, http_port=0)
        try:
            assert server.wait_until_http_ready()
            with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}",
                                       options=GRPC_OPTIONS) as channel:
                stub = pb_grpc.CoordinatorStub(channel)
                for name in ("gpu", "desk", "laptop"):
                    stub.Join(join_request(server, name=name))
            rows = [measure(server, n, args.polls) for n in lengths]
        finally:
            server.stop()
    print(f"{sys.version.split()[0]} | 3 members, 3 tiers | median of {args.polls} polls, "
          "interleaved")
    print_table(["rounds", "page poll ms", "page poll KiB", "first load ms", "first load KiB",
                 "/metrics ms", "page poll / metrics", "lock ms"], rows)


def measure(server: RunningServer, rounds: int, polls: int) -> list[str]:
    c = server.service.coordinator
    with c._lock:
        fill(c, rounds)
    base = f"http://127.0.0.1:{server.http_port}"
    last_event = c.state.events[-1]["seq"] if c.state.events else -1
    urls = {"poll": f"{base}/api/dashboard?since_round={max(rounds - 1, 0)}"
                    f"&events_after={last_event}",
            "first": f"{base}/api/dashboard", "metrics": f"{base}/metrics"}
    times: dict[str, list[float]] = {k: [] for k in urls}
    sizes: dict[str, int] = {}
    for _ in range(polls):
        for key, url in urls.items():
            start = time.perf_counter()
            sizes[key] = fetch(url)
            times[key].append(time.perf_counter() - start)
    locks = []
    for _ in range(polls):
        start = time.perf_counter()
        c.snapshot(since_round=max(rounds - 1, 0), events_after=last_event)
        locks.append(time.perf_counter() - start)
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return [f"{rounds:,}", f"{ms['poll']:.1f}", f"{sizes['poll'] / 1024:.1f}",
            f"{ms['first']:.1f}", f"{sizes['first'] / 1024:.0f}", f"{ms['metrics']:.1f}",
            f"{ms['poll'] / ms['metrics']:.2f}", f"{statistics.median(locks) * 1e3:.2f}"]


if __name__ == "__main__":
    main()
