"""What readers that never read cost the coordinator's HTTP side (issue 47): is ``/status``
still answered at once while N connections hang on a round's update blob, and does the
server's memory come back once they close?

A real coordinator (``RunningServer.start``, as ``matformer server`` runs it, its [server]
settings at their defaults) serves on loopback in a process of its own, so that its resident
memory is its own. One member joins at tier 0 and closes one round with a compressed result
of that tier's size (``scale.Submissions``: DCT, top 32 of 64, bfloat16, the run's defaults),
so the blob is a real one: round 0's update at tier 0, as ``/updates`` lists it (the 150m
shape's, 162M parameters, with the default broadcast: 4.7 MiB). Then, over real HTTP:

- ``reference``: ``/status`` and ``/api/run``, ``--requests`` each, interleaved, one
  connection each, with no reader attached: p50 and p99;
- per pass: the same once ``--readers`` sockets (with a 4 KiB receive buffer) have each
  asked for the blob and read nothing, spread over ``--addresses`` loopback addresses
  (127.x.y.z: one each by default, so the per-address cap refuses none of them);
- the server's RSS (``/proc/PID/status``) before the readers (``rss_mib_before``), while
  they hang (``rss_mib_during``, after ``--settle-s``) and once they closed and the server's
  count of blobs being sent (``BlobStore.streams``) was back to 0 (``rss_mib_after``);
  ``streams_open``: that count while they hung.

The readers come ``--passes`` times (``passes``, one object each): the first pass also
grows what a burst leaves for good (the worker threads of the HTTP side's pool and their
allocator arenas), so the memory after the last pass against after the first shows whether
readers leave anything behind. ``status p99 with readers / without (the worst pass)`` is the
ratio to read (``status_p99_ratio``), beside the memory (docs/operations.md, "The HTTP side
under load", has the figures from before the blobs were sent in pieces).

    python bench/slow_readers.py --json runs/slow_readers.json   # 300 readers, 150m (40 s)
    python bench/slow_readers.py --addresses 1           # one address: its cap refuses most
    python bench/slow_readers.py --smoke                  # 8 readers, micro model: it runs
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from multiprocessing.connection import Connection as PipeEnd
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
from harness import parse, print_table
from scale import Submissions, join, model_config, play_round
from utilization import SHAPES

from matformer.modeling.mdat import build_default_mdat
from matformer.protocol.channel import GRPC_OPTIONS
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.server.config import RunConfig
from matformer.server.main import RunningServer

SMOKE = {"shape": "micro", "readers": 8, "addresses": 8, "requests": 10, "settle_s": 0.2}
JOIN_TOKEN = "bench"
SEQ_LEN = 128
STOP = "stop"
ANSWER_S = 600.0  # the longest the server's process may take to start (a 150m checkpoint)
RECEIVE_BUFFER = 4096  # a reader's socket: what it would take before it reads
ENDPOINTS = {"status": "/status", "api": "/api/run"}
LATENCIES = ("status_p50_ms", "status_p99_ms", "api_p50_ms", "api_p99_ms")
QUIET_S = 30.0  # the longest the server may take to count the readers' streams as ended


def run_config(shape: dict[str, int], folder: Path) -> RunConfig:
    """One tier-0 member, rounds that wait for it, no checkpoint after the first."""
    model = model_config(SimpleNamespace(**shape, seq_len=SEQ_LEN))
    return RunConfig.from_dict({
        "run": {"id": "slow-readers", "dir": str(folder / "run")},
        "model": {"inline": {k: v for k, v in model.to_dict().items() if v is not None}},
        "data": {"path": str(folder / "docs.mdat"), "max_seq_len": SEQ_LEN},
        "tiers": {"allowed": [0]},
        "round": {"min_clients": 1, "deadline_s": 3600.0, "rounds": 3,
                  "tokens_per_round": 4 * SEQ_LEN},
        "checkpoint": {"every_rounds": 10**6},
        "faults": {"heartbeat_timeout_s": 3600.0},
        "auth": {"join_token": JOIN_TOKEN},
    }, base=folder)


def serve(shape: dict[str, int], folder: Path, pipe: PipeEnd) -> None:
    """(the server's process) Serve the run, close round 0, send the HTTP port; then answer
    each request with the number of blobs being sent, until STOP."""
    build_default_mdat(folder / "docs.mdat", limit=30).close()
    running = RunningServer.start(run_config(shape, folder), grpc_port=0, http_port=0)
    try:
        assert running.wait_until_http_ready()
        submissions = Submissions(SimpleNamespace(**shape, seq_len=SEQ_LEN, **{
            key: getattr(running.coordinator.config.compression, key)
            for key in ("encoding", "chunk", "topk", "value_dtype")}))
        with grpc.insecure_channel(f"127.0.0.1:{running.grpc_port}",
                                   options=GRPC_OPTIONS) as channel:
            stub = pb_grpc.CoordinatorStub(channel)
            play_round(stub, [join(stub, running, 0, 0, submissions)], running.coordinator)
        blobs = running.http_server.config.app.state.blobs
        pipe.send(running.http_port)
        while pipe.recv() != STOP:
            pipe.send(sum(blobs.streams.values()))
    finally:
        running.stop()


def open_streams(pipe: PipeEnd) -> int:
    """The blobs the server is sending now (``BlobStore.streams``)."""
    pipe.send("streams")
    return pipe.recv()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


def fetch(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=60) as reply:
        return reply.read()


def latencies(base: str, requests: int) -> dict[str, float]:
    """p50 and p99 (ms) of each endpoint, asked ``requests`` times, interleaved."""
    times: dict[str, list[float]] = {name: [] for name in ENDPOINTS}
    for _ in range(requests):
        for name, path in ENDPOINTS.items():
            start = time.perf_counter()
            fetch(base + path)
            times[name].append((time.perf_counter() - start) * 1e3)
    figures = {}
    for name, ms in times.items():
        cuts = statistics.quantiles(ms, n=100, method="inclusive")
        figures[f"{name}_p50_ms"], figures[f"{name}_p99_ms"] = statistics.median(ms), cuts[98]
    return figures


@contextlib.contextmanager
def readers(port: int, path: str, count: int, addresses: int) -> Iterator[list[socket.socket]]:
    """``count`` connections that ask for ``path`` and never read, reader i from loopback
    address 127.0.0.2 + (i mod ``addresses``); closed on exit."""
    sockets = []
    try:
        for i in range(count):
            a = 2 + i % addresses
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
            sock.bind((f"127.{a >> 16 & 255}.{a >> 8 & 255}.{a & 255}", 0))
            sock.connect(("127.0.0.1", port))
            sock.sendall(f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
            sockets.append(sock)
        yield sockets
    finally:
        for sock in sockets:
            sock.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="150m",
                        help="micro: 0.2M parameters; tiny: 4M; 150m: 162M")
    parser.add_argument("--readers", type=int, default=300, help="connections that never read")
    parser.add_argument("--addresses", type=int, default=None,
                        help="loopback addresses they come from (default: one each)")
    parser.add_argument("--passes", type=int, default=2, help="times the readers come")
    parser.add_argument("--requests", type=int, default=200,
                        help="requests of each endpoint, per phase")
    parser.add_argument("--settle-s", type=float, default=1.5,
                        help="how long the readers hang before the server is measured")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parse(parser, SMOKE, argv)
    addresses = args.addresses or args.readers
    context = multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="matformer-bench-") as folder:
        pipe, theirs = context.Pipe()
        server = context.Process(target=serve, args=(SHAPES[args.shape], Path(folder), theirs),
                                 name="coordinator", daemon=True)
        server.start()
        theirs.close()
        try:
            if not pipe.poll(ANSWER_S):
                raise SystemExit(f"the server's process did not start in {ANSWER_S:g} s")
            port = pipe.recv()
            figures = measure(args, addresses, server.pid, port, pipe)
        finally:
            with contextlib.suppress(OSError):
                pipe.send(STOP)
            server.join(timeout=60)
    figures["settings"] = {"shape": args.shape, "requests": args.requests,
                           "settle_s": args.settle_s, "cores": os.cpu_count(),
                           "python": sys.version.split()[0]}
    print(f"{args.shape} | update blob {figures['blob_bytes'] / 2**20:.2f} MiB | "
          f"{args.readers} readers from {addresses} addresses, {args.passes} passes | "
          f"{args.requests} requests per endpoint | {os.cpu_count()} cores")
    ref = figures["reference"]
    rows = [["no readers", "", *(f"{ref[k]:.1f}" for k in LATENCIES),
             f"{figures['rss_mib_before']:.0f}"]]
    for n, hung in enumerate(figures["passes"], 1):
        rows += [[f"pass {n}: {args.readers} readers", str(hung["streams_open"]),
                  *(f"{hung[k]:.1f}" for k in LATENCIES), f"{hung['rss_mib_during']:.0f}"],
                 [f"pass {n}: closed", "0", "", "", "", "", f"{hung['rss_mib_after']:.0f}"]]
    print_table(["", "being sent", "/status p50 ms", "/status p99 ms", "/api/run p50 ms",
                 "/api/run p99 ms", "server RSS MiB"], rows)
    print(f"status p99 with readers / without (the worst pass): "
          f"{figures['status_p99_ratio']:.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


def measure(args: argparse.Namespace, addresses: int, pid: int, port: int, pipe: PipeEnd
            ) -> dict[str, Any]:
    base = f"http://127.0.0.1:{port}"
    [entry] = json.loads(fetch(f"{base}/updates?since_round=0&tier=0"))["updates"]
    fetch(base + entry["url"])  # the blob framed and cached, as a first member's fetch leaves it
    reference = latencies(base, args.requests)
    before = rss_mib(pid)
    passes = []
    for _ in range(args.passes):
        with readers(port, entry["url"], args.readers, addresses):
            time.sleep(args.settle_s)
            hung = {"rss_mib_during": rss_mib(pid), "streams_open": open_streams(pipe),
                    **latencies(base, args.requests)}
        give_up = time.monotonic() + QUIET_S
        while open_streams(pipe):
            if time.monotonic() > give_up:
                raise SystemExit(f"the server still sends blobs {QUIET_S:g} s after the "
                                 "readers left")
            time.sleep(0.1)
        time.sleep(args.settle_s)
        passes.append({**hung, "rss_mib_after": rss_mib(pid)})
    return {"readers": args.readers, "addresses": addresses, "blob_bytes": entry["bytes"],
            "reference": reference, "passes": passes, "rss_mib_before": before,
            "status_p99_ratio": max(p["status_p99_ms"] for p in passes)
            / reference["status_p99_ms"]}


if __name__ == "__main__":
    main()
