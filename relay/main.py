"""``matformer relay --upstream HOST:PORT``: a relay between the root coordinator and the
members near it (docs/scaling.md, "Relays").

    matformer relay --upstream root.example:7070 --port 7170 --name relay-eu
    matformer client train --server relay.example:7170 --name laptop   # as if to the root

Members join the relay with the run's join token, as they would the root. The relay runs
until the root's run finishes, or Ctrl-C / SIGTERM, then leaves the root.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from pathlib import Path

import grpc

from matformer.modeling.commands import command_parser
from matformer.modeling.errors import MatformerError
from matformer.protocol.channel import GRPC_OPTIONS
from matformer.protocol.health import add_health
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.relay.relay import Relay
from matformer.relay.service import RelayService
from matformer.relay.upstream import Upstream

JOIN_TOKEN_ENV = "MATFORMER_JOIN_TOKEN"
WORKERS = 64  # calls served at once: each member holds up to four


class RunningRelay:
    """A relay serving on ``port`` (0: any free one; ``port`` says which)."""

    def __init__(self, relay: Relay, join_token: str, *, host: str, port: int) -> None:
        self.relay = relay
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=WORKERS),
                                  options=GRPC_OPTIONS)
        pb_grpc.add_CoordinatorServicer_to_server(RelayService(relay, join_token), self.server)
        add_health(self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")

    @classmethod
    def start(cls, upstream: str, *, name: str, join_token: str, folder: Path,
              host: str = "127.0.0.1", port: int = 0, deadline_s: float = 45.0,
              topk: int = 0, mirror: str | None = None,
              log: Callable[[str], None] = print) -> RunningRelay:
        relay = Relay(Upstream(upstream, name=name, join_token=join_token),
                      deadline_s=deadline_s, folder=folder, topk=topk, mirror=mirror, log=log)
        relay.start()
        running = cls(relay, join_token, host=host, port=port)
        running.server.start()
        return running

    def stop(self, reason: str) -> None:
        self.server.stop(grace=2).wait()
        self.relay.stop(reason)


def parser() -> argparse.ArgumentParser:
    p = command_parser("matformer-relay", "A relay between the root coordinator and the "
                       "members near it: one member to the root, a coordinator to them.")
    p.add_argument("--upstream", required=True, metavar="HOST:PORT",
                   help="the root coordinator's gRPC address")
    p.add_argument("--host", default="127.0.0.1",
                   help="where members reach this relay (default: 127.0.0.1; 0.0.0.0: any)")
    p.add_argument("--port", type=int, default=7170, help="its gRPC port (default: 7170)")
    p.add_argument("--name", default="relay", help="the relay's name at the root")
    p.add_argument("--join-token", default=None,
                   help=f"the run's join token (default: ${JOIN_TOKEN_ENV})")
    p.add_argument("--deadline-s", type=float, default=45.0,
                   help="how long members have for a round before the relay hands in what "
                        "it has; keep it under the run's [round] deadline_s (default: 45)")
    p.add_argument("--topk", type=int, default=0, metavar="K",
                   help="0 (default): hand the root the members' exact sum, which grows with "
                        "the coefficients they send; K: only the K largest per chunk, the rest "
                        "carried to the next round (lossy, one member's size however many)")
    p.add_argument("--mirror", default=None, metavar="URL",
                   help="base URL of an HTTP cache of the root's HTTP side: round updates and "
                        "checkpoint files come from there, checked by sha256, and from the "
                        "root whenever it fails (as matformer client --mirror)")
    p.add_argument("--dir", type=Path, default=Path("runs/relay"),
                   help="where the relay keeps checkpoint files (default: runs/relay)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    token = args.join_token if args.join_token is not None else os.environ.get(
        JOIN_TOKEN_ENV, "")
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    try:
        running = RunningRelay.start(args.upstream, name=args.name, join_token=token,
                                     folder=args.dir, host=args.host, port=args.port,
                                     deadline_s=args.deadline_s, topk=args.topk,
                                     mirror=args.mirror,
                                     log=lambda line: print(f"relay: {line}", flush=True))
    except MatformerError as error:
        print(f"matformer relay: error: {error}", file=sys.stderr)
        return 2
    except grpc.RpcError as error:
        print(f"matformer relay: error: the root at {args.upstream} answered "
              f"{error.code().name}: {error.details()}", file=sys.stderr)
        return 2
    print(f"relay: listening on {args.host}:{running.port}", flush=True)
    try:
        while not stopping.wait(0.5) and not running.relay.finished:
            pass
        if running.relay.finished:  # its members learn it from this relay: serve them on
            running.relay.wait_for_members(running.relay.member_timeout_s)
    except KeyboardInterrupt:
        pass
    running.stop("finished" if running.relay.finished else "stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
