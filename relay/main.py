"""``matformer relay --upstream HOST:PORT``: a relay between the root coordinator and the
members near it (docs/scaling.md, "Relays").

    matformer relay --upstream root.example:7070 --port 7170 --name relay-eu
    matformer client train --server relay.example:7170 --name laptop   # as if to the root

The root grants the relay role: a relay presents the run's relay token (``[auth]
relay_token``, in ``$MATFORMER_RELAY_TOKEN`` above) or, where the root admits only client
keys, a key issued with ``matformer-server keys add NAME --relay``. A member's credential
never admits a relay, and the relay's own is never handed to its members: they join it with
``--member-token`` (else ``$MATFORMER_MEMBER_TOKEN``, else the run's join token in
``$MATFORMER_JOIN_TOKEN``, as they would join the root). The relay runs until the root's run
finishes, or Ctrl-C / SIGTERM, then leaves the root.

Over TLS, and into a run whose root admits only client keys (``[auth] mode = "keys"``):

    matformer relay --upstream root.example:7070 --tls-ca root-ca.pem \\
        --relay-token "$RELAY_KEY" --member-token "$LAB_TOKEN" \\
        --tls-cert relay.pem --tls-key relay-key.pem --host 0.0.0.0
    matformer client train --server relay.example:7170 --tls-ca relay.pem --join-token "$LAB_TOKEN"
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from matformer.modeling.commands import command_parser
from matformer.modeling.errors import MatformerError
from matformer.modeling.settings import add_flags, given_flags, read_table, setting
from matformer.modeling.threads import add_threads_option, use_threads
from matformer.protocol.auth import tokens_equal
from matformer.protocol.channel import GRPC_OPTIONS, is_loopback, listen
from matformer.protocol.health import add_health
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.relay.relay import DEADLINE_SHARE, Relay, RelayError
from matformer.relay.upstream import Upstream
from matformer.server.call_slots import CallLimits, RequestGate
from matformer.server.errors import UpstreamError
from matformer.server.sections.checks import MAX_SECONDS
from matformer.server.service import CoordinatorService

JOIN_TOKEN_ENV = "MATFORMER_JOIN_TOKEN"
RELAY_TOKEN_ENV = "MATFORMER_RELAY_TOKEN"
MEMBER_TOKEN_ENV = "MATFORMER_MEMBER_TOKEN"
LIMITS = CallLimits()  # what one member's calls may hold of the relay: the root's defaults


@dataclass(frozen=True, slots=True)
class Access:
    """How a relay reaches the root and who may join it.

    ``relay_token`` is what the relay presents to the root: the run's relay token, or the
    relay's key where the root admits only keys ("" where the root admits anyone on its
    machine). ``member_token`` is what its members present to it; it must be given whenever
    the relay token is, and differ from it: the relay token grants the relay role at the
    root, so a member holding it could speak for others there. ``tls_ca`` is the root's
    certificate (TLS to the root); ``tls_cert`` and ``tls_key``, the relay's own, serve its
    members over TLS."""

    relay_token: str
    member_token: str | None = None
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            given, absent = ("cert", "key") if self.tls_key is None else ("key", "cert")
            raise RelayError(f"--tls-{given} is given but not --tls-{absent}; give both (the "
                             "relay's certificate and its private key) or neither.")
        for flag, path in (("--tls-ca", self.tls_ca), ("--tls-cert", self.tls_cert),
                           ("--tls-key", self.tls_key)):
            if path is not None and not Path(path).is_file():
                raise RelayError(f"{flag} {path} does not exist; fix the path.")
        if self.relay_token and not self.member_token:
            raise RelayError("no token for the relay's members: give --member-token (or "
                             f"${MEMBER_TOKEN_ENV}, or the run's join token in "
                             f"${JOIN_TOKEN_ENV}); the relay token is never theirs.")
        if self.relay_token and tokens_equal(self.member_token, self.relay_token):
            raise RelayError("the member token is the relay token, which grants the relay "
                             "role at the root; give the relay's members a token of their own "
                             "(--member-token).")

    @property
    def members(self) -> str:
        """The token members present to this relay ("" where the root asks for none)."""
        return self.member_token or ""


class RunningRelay:
    """A relay serving on ``port`` (0: any free one; ``port`` says which)."""

    def __init__(self, relay: Relay, access: Access, *, host: str, port: int) -> None:
        self.relay = relay
        # the root's own servicer and call limits, over the relay's member API
        service = CoordinatorService(relay, LIMITS)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=LIMITS.workers),
                                  options=GRPC_OPTIONS,
                                  interceptors=[RequestGate(service.slots,
                                                            relay.sessions.client_of)])
        pb_grpc.add_CoordinatorServicer_to_server(service, self.server)
        add_health(self.server)
        self.port = listen(self.server, f"{host}:{port}", cert=access.tls_cert,
                           key=access.tls_key)

    @classmethod
    def start(cls, upstream: str, *, name: str, access: Access, folder: Path,
              host: str = "127.0.0.1", port: int = 0, deadline_s: float | None = None,
              topk: int = 0, mirror: str | None = None, min_members: int = 1,
              trust_remote_code: bool = False,
              log: Callable[[str], None] = print) -> RunningRelay:
        relay = Relay(Upstream(upstream, name=name, join_token=access.relay_token,
                               tls_ca=access.tls_ca), member_token=access.members,
                      deadline_s=deadline_s, folder=folder, topk=topk, mirror=mirror,
                      min_members=min_members, trust_remote_code=trust_remote_code, log=log)
        relay.start()
        try:
            running = cls(relay, access, host=host, port=port)
        except RuntimeError as err:  # grpc's answer to a taken port
            relay.stop("its port is taken")
            raise RelayError(f"cannot listen on {host}:{port} ({err}); another process holds "
                             "the port: stop it or choose another --port.") from None
        running.server.start()
        if access.tls_cert is None and not is_loopback(host):
            log(f"warning: members reach {host}:{running.port} over plaintext: their tokens, "
                "results and weights cross the network unencrypted; give --tls-cert and "
                "--tls-key to serve them over TLS.")
        return running

    def stop(self, reason: str) -> None:
        self.server.stop(grace=2).wait()
        self.relay.stop(reason)


@dataclass(kw_only=True, slots=True)
class RelaySettings:
    """What ``matformer relay`` takes, one flag per key (``modeling.settings.add_flags``)."""

    upstream: str = setting(help="the root coordinator's gRPC address, HOST:PORT")
    host: str = setting("127.0.0.1", help="where members reach this relay (0.0.0.0: any)")
    port: int = setting(7170, low=0, high=65535, help="its gRPC port (0: any free one)")
    name: str = setting("relay", help="the relay's name at the root")
    relay_token: str | None = setting(None, secret=True, help=(
        "what the relay presents to the root: the run's relay token ([auth] relay_token), "
        "or its relay key where the root runs [auth] mode = \"keys\" (keys add NAME "
        f"--relay) (unset: ${RELAY_TOKEN_ENV})"))
    member_token: str | None = setting(None, secret=True, help=(
        f"the token this relay's members present to it (unset: ${MEMBER_TOKEN_ENV}, else "
        f"the run's join token in ${JOIN_TOKEN_ENV}); never the relay token"))
    tls_ca: Path | None = setting(None, help=(
        "the root's certificate (PEM) to trust: connect to the root with TLS"))
    tls_cert: Path | None = setting(None, help=(
        "serve members over TLS with this certificate chain (PEM; with --tls-key)"))
    tls_key: Path | None = setting(None, help="the private key (PEM) of --tls-cert")
    deadline_s: float | None = setting(None, low=0, above=True, high=MAX_SECONDS, help=(
        "how long members have for a round before the relay hands in what it has; at most "
        f"the run's [round] deadline_s, which the root says (unset: {DEADLINE_SHARE:g} of "
        "it)"))
    min_members: int = setting(1, low=1, help=(
        "members ready (their speed known) before the relay takes its first round from the "
        "root, as [round] min_clients is for the root; the first to join then does not get "
        "the first rounds alone"))
    topk: int = setting(0, low=0, help=(
        "0: hand the root the members' exact sum, which grows with the coefficients they "
        "send; K: only the K largest per chunk, the rest carried to the next round (lossy, "
        "one member's size however many)"))
    mirror: str | None = setting(None, help=(
        "base URL of an HTTP cache of the root's HTTP side: round updates and checkpoint "
        "files come from there, checked by sha256, and from the root whenever it fails (as "
        "matformer client --mirror)"))
    dir: Path = setting(Path("runs/relay"), help="where the relay keeps checkpoint files")
    trust_remote_code: bool = setting(False, help=(
        "run the module files the root's checkpoint names (the run's own model components); "
        "read them first: they run with your rights"))


def parser() -> argparse.ArgumentParser:
    p = command_parser("matformer-relay", "A relay between the root coordinator and the "
                       "members near it: one member to the root, a coordinator to them.")
    add_flags(p, RelaySettings)
    add_threads_option(p)
    return p


def settings_of(args: argparse.Namespace) -> RelaySettings:
    """The command line's settings, each checked against its declaration."""
    return read_table(RelaySettings, given_flags(args, RelaySettings), "relay", Path.cwd())


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.upstream is None:
        p.error("--upstream HOST:PORT is required: the root coordinator's gRPC address")
    try:
        given = settings_of(args)
    except MatformerError as error:
        p.error(str(error))
    token = given.relay_token if given.relay_token is not None else os.environ.get(
        RELAY_TOKEN_ENV, "")
    members = next((t for t in (given.member_token, os.environ.get(MEMBER_TOKEN_ENV),
                                os.environ.get(JOIN_TOKEN_ENV)) if t is not None), None)
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    try:
        print(f"relay: folding results with {use_threads(args.threads).describe()}", flush=True)
        # the files as typed, which errors repeat (the settings hold them made absolute)
        access = Access(token, members, tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                        tls_key=args.tls_key)
        running = RunningRelay.start(given.upstream, name=given.name, access=access,
                                     folder=given.dir, host=given.host, port=given.port,
                                     deadline_s=given.deadline_s, topk=given.topk,
                                     mirror=given.mirror, min_members=given.min_members,
                                     trust_remote_code=given.trust_remote_code,
                                     log=lambda line: print(f"relay: {line}", flush=True))
    except UpstreamError as error:
        print(f"matformer relay: error: the root at {given.upstream} answered "
              f"{error.code.name}: {error.details}", file=sys.stderr)
        return 2
    except MatformerError as error:
        print(f"matformer relay: error: {error}", file=sys.stderr)
        return 2
    print(f"relay: listening on {given.host}:{running.port}", flush=True)
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
