"""``matformer-server --config run.toml``: the coordinator with its gRPC and HTTP servers.
``--set SECTION.KEY=VALUE`` (repeatable, VALUE in TOML) overrides one key of run.toml.

    server = RunningServer.start(config)      # ports from [server]; tests pass port 0
    server.grpc_port, server.http_port       # the ports actually bound
    server.stop()

gRPC (the Coordinator and health services) runs on its own thread pool; the HTTP app runs
under uvicorn on a thread; both use TLS when [tls] names cert and key, and both bind
[server] host, or loopback only under [auth] mode = "none" (a host beyond loopback without
TLS is served, with a warning at start). A third thread is the coordinator's close worker
(``Coordinator.run_closes``): it closes each round as soon as it is ready and at its deadline
even when no client calls, so no member's call waits for a close. SIGINT/SIGTERM stop all
three; state.json is already on disk. Once the run is finished the server logs its summary
and exits 0 when the members have left, unless [server] stay_after_finish
(``server/run_end.py``).
"""

from __future__ import annotations

import ipaddress
import logging
import signal
import socket
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc
import uvicorn

from matformer.modeling.commands import command_parser
from matformer.modeling.errors import MatformerError
from matformer.modeling.threads import add_threads_option, use_threads
from matformer.protocol.channel import GRPC_OPTIONS, is_loopback, listen
from matformer.protocol.health import add_health
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.server.call_slots import RequestGate
from matformer.server.config import RunConfig
from matformer.server.coordinator import Coordinator
from matformer.server.errors import PortUnavailable
from matformer.server.heartbeats import HeartbeatDoor
from matformer.server.http import build_app, http_options
from matformer.server.keys import KeyFile
from matformer.server.run_end import END_POLL_S, RunEnd
from matformer.server.service import CoordinatorService

# The server pings a connection quiet for KEEPALIVE_S and closes it, ending its calls, when
# the ping is not answered within KEEPALIVE_TIMEOUT_S: a vanished client's calls free their
# worker threads.
KEEPALIVE_S = 60
KEEPALIVE_TIMEOUT_S = 20
STOP_GRACE_S = 2.0

log = logging.getLogger("matformer.server")


@dataclass(kw_only=True)
class RunningServer:
    coordinator: Coordinator
    service: CoordinatorService  # its .coordinator is the same one
    grpc_server: grpc.Server
    http_server: uvicorn.Server
    host: str  # the address both servers bound
    grpc_port: int
    http_port: int
    _threads: list[threading.Thread]
    _stopping: threading.Event
    door: HeartbeatDoor | None = None  # [server] heartbeat_port: beats answered apart

    @classmethod
    def start(cls, config: RunConfig, *, grpc_port: int | None = None,
              http_port: int | None = None) -> RunningServer:
        """Build the coordinator (resuming config.run.dir) and start serving."""
        host, tls, limits = bind_host(config), config.tls, config.faults.call_limits()
        if config.auth.mode == "keys":
            issued = len(KeyFile(config.keys_path).entries())  # KeyFileError if unreadable
            log.log(logging.INFO if issued else logging.WARNING,
                    '[auth] mode = "keys": %d client keys in %s%s', issued, config.keys_path,
                    "" if issued else "; issue one with matformer-server keys add NAME")
        coordinator = Coordinator(config)
        service = CoordinatorService(coordinator, limits)
        sessions = coordinator.membership.sessions
        grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=limits.workers),
                                  options=server_options(config),
                                  interceptors=[RequestGate(service.slots, sessions.client_of)])
        pb_grpc.add_CoordinatorServicer_to_server(service, grpc_server)
        add_health(grpc_server)
        port = config.server.grpc_port if grpc_port is None else grpc_port
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"  # IPv6 in brackets
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            http_address = (host, config.server.http_port if http_port is None else http_port)
            sock.bind(http_address)
            bound_grpc = listen(grpc_server, address, cert=tls.cert, key=tls.key)
        except (OSError, RuntimeError) as err:  # grpc raises RuntimeError for a taken port
            sock.close()
            raise PortUnavailable(
                f"cannot listen on {host} (gRPC port {port}, HTTP port {http_address[1]}): "
                f"{err}. Another process holds the port, or the address is not this "
                "machine's; stop it or choose [server] grpc_port / http_port.") from None
        door = None
        if config.server.heartbeat_port is not None:
            try:
                door = HeartbeatDoor.start(
                    sessions=sessions, news=coordinator.beat_news,
                    apply=coordinator.apply_beats, host=host,
                    port=config.server.heartbeat_port, cert=tls.cert, key=tls.key)
            except PortUnavailable:
                sock.close()
                grpc_server.stop(0)
                raise
            service.heartbeat_port = door.port
        grpc_server.start()
        http_server = uvicorn.Server(uvicorn.Config(
            build_app(coordinator), log_level="warning", **http_options(config.server),
            ssl_certfile=tls.cert if tls.enabled else None,
            ssl_keyfile=tls.key if tls.enabled else None))
        stopping = threading.Event()
        threads = [threading.Thread(target=http_server.run, kwargs={"sockets": [sock]},
                                    name="matformer-http", daemon=True),
                   threading.Thread(target=coordinator.run_closes, args=(stopping,),
                                    name="matformer-close", daemon=True)]
        for thread in threads:
            thread.start()
        server = cls(coordinator=coordinator, service=service, grpc_server=grpc_server,
                     http_server=http_server, host=host, grpc_port=bound_grpc,
                     http_port=sock.getsockname()[1], _threads=threads, _stopping=stopping,
                     door=door)
        log.info("run %s: gRPC on %s:%d (%s), %s on %s:%d%s", config.run.id, host, bound_grpc,
                 "TLS" if tls.enabled else "plaintext", "HTTPS" if tls.enabled else "HTTP",
                 host, server.http_port,
                 "" if door is None else f", heartbeats on {host}:{door.port}")
        return server

    def wait_until_http_ready(self, timeout_s: float = 10.0) -> bool:
        """uvicorn starts on its thread; True once it accepts connections."""
        deadline = time.monotonic() + timeout_s
        while not self.http_server.started and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.http_server.started

    def stop(self) -> None:
        self._stopping.set()
        self.http_server.should_exit = True
        self.grpc_server.stop(STOP_GRACE_S).wait()
        if self.door is not None:
            self.door.stop()
        for thread in self._threads:
            thread.join(timeout=STOP_GRACE_S + 3)
        try:
            self.coordinator.close()  # joins and leaves of the last second
        except Exception:  # stopping goes on; the run resumes from the last good save
            log.exception("saving state.json on stop failed")


def bind_host(config: RunConfig) -> str:
    """The address both servers bind: [server] host, except that a run without a join token
    ([auth] mode = "none") listens on loopback only (::1 if host is an IPv6 loopback, else
    127.0.0.1); then it logs one warning saying so. A host beyond loopback without [tls] logs
    a warning too: tokens, results and weights would cross the network in plaintext."""
    host = config.server.host
    if config.auth.mode != "none":
        if not config.tls.enabled and not is_loopback(host):
            log.warning("[server] host %r accepts other machines over plaintext: join and session "
                        "tokens, results and weights cross the network unencrypted. Set [tls] "
                        "cert and key (a PEM certificate and its private key) in run.toml to "
                        "serve gRPC and HTTPS over TLS.", host)
        return host
    try:
        ipv6_loopback = ipaddress.ip_address(host) == ipaddress.ip_address("::1")
    except ValueError:  # a name such as "localhost"
        ipv6_loopback = False
    loopback = "::1" if ipv6_loopback else "127.0.0.1"
    ignored = f"; [server] host {host!r} is ignored" if host != loopback else ""
    log.warning('[auth] mode = "none": any client on this machine joins without a join token, '
                'so gRPC and HTTP listen on %s only%s. Set mode = "token" and a join token to '
                "accept other machines.", loopback, ignored)
    return loopback



def server_options(config: RunConfig) -> tuple[tuple[str, int], ...]:
    """gRPC's options with the receive limit of [faults] max_message_mb (a larger message is
    refused by gRPC itself, RESOURCE_EXHAUSTED, before any handler reads it) and keepalive.
    No ``maximum_concurrent_rpcs``: it would refuse honest calls as readily as a flood, before
    knowing whose they are; the service's per-member call slots tell them apart."""
    limit = config.faults.max_message_bytes
    return (*((k, limit if k == "grpc.max_receive_message_length" else v)
              for k, v in GRPC_OPTIONS),
            ("grpc.so_reuseport", 0),  # a second server on a taken port fails, not shares it
            ("grpc.keepalive_time_ms", KEEPALIVE_S * 1000),
            ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_S * 1000))


def keys_main(argv: list[str]) -> int:
    """``matformer-server keys add|remove|list``: the run's client keys (server/keys.py)."""
    parser = command_parser(
        "matformer-server keys",
        "Issue, remove and list the client keys of a run with [auth] mode = \"keys\".")
    parser.add_argument("action", choices=("add", "remove", "list"))
    parser.add_argument("name", nargs="?", help="the member name the key carries (add, remove)")
    parser.add_argument("--config", type=Path, required=True, help="the run's run.toml")
    parser.add_argument("--relay", action="store_true", help=(
        "add: a relay's key (matformer relay --relay-token), which admits a relay and no "
        "member; a member's key never admits a relay"))
    args = parser.parse_args(argv)
    if args.relay and args.action != "add":
        parser.error("--relay goes with keys add")
    if args.action != "list" and not args.name:
        parser.error(f"keys {args.action} needs a NAME")
    try:
        config = RunConfig.load(args.config)
        keys = KeyFile(config.keys_path)
        if args.action == "add":
            key = keys.add(args.name, relay=args.relay)
            flag = ("--relay-token (or $MATFORMER_RELAY_TOKEN) of matformer relay" if args.relay
                    else "--join-token (or $MATFORMER_JOIN_TOKEN)")
            print(f"{key}\n\nThe {'relay ' if args.relay else ''}key for {args.name!r}: give it "
                  f"to its holder once, to pass as {flag}. {keys.path} keeps only its hash.")
        elif args.action == "remove":
            keys.remove(args.name)
            print(f"removed the key of {args.name!r}; its holder can no longer join (a member "
                  "joined with it stays until it leaves or is excluded).")
        else:
            for name, entry in sorted(keys.entries().items()):
                issued = time.strftime("%Y-%m-%d %H:%M", time.gmtime(entry["issued"]))
                print(f"{name}\t{entry.get('role', 'member')}\tissued {issued} UTC")
    except MatformerError as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    if config.auth.mode != "keys":
        print(f"note: {args.config} has [auth] mode = \"{config.auth.mode}\"; the coordinator "
              "checks keys only with mode = \"keys\".", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["keys"]:
        return keys_main(argv[1:])
    parser = command_parser(
        "matformer-server", "Coordinate a federated Matformer run.",
        epilog="matformer-server keys add|remove|list NAME --config run.toml manages the "
               "client keys of a run with [auth] mode = \"keys\".")
    parser.add_argument("--config", type=Path, required=True, help="the run's run.toml")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE",
                        help="override one key of the config (VALUE in TOML syntax), e.g. "
                             "--set round.rounds=5; repeatable")
    add_threads_option(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        log.info("closing rounds with %s", use_threads(args.threads).describe())
        config = RunConfig.load(args.config, args.overrides)
        server = RunningServer.start(config)
    except MatformerError as err:
        print(f"matformer-server: {err}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    end = RunEnd.of(server.coordinator, stay=config.server.stay_after_finish)
    worker = server.coordinator.worker
    while not stop.wait(END_POLL_S) and not end.reached() and worker.fatal is None:
        pass
    if worker.fatal is not None:
        print(f"matformer-server: {worker.fatal}", file=sys.stderr)
        server.stop()
        return 1
    if stop.is_set():
        log.info("stopping; %s", "the run is finished" if end.finished_at is not None else
                 f"the run resumes from {server.coordinator.dir}")
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
