"""One coordinator and N clients as processes on loopback, watched until the run finishes.

    net = Testnet(plan)
    status = net.run()   # the final /status JSON; TestnetFailed when a child dies
    net.stop()           # always: stops whatever is still running

The server is ``python -m matformer.server.main --config run.toml --set ...``; each client is
``python -m matformer.client.cli train --server 127.0.0.1:PORT ...`` with its own state dir. The
testnet polls ``GET /status`` to follow the run and carries out the plan's ``events``
(``--kill-client-at`` or ``--chaos``, local_testnet/chaos.py): once an event's round is open
it SIGKILLs the client (or the server), then restarts it with the same command, name and
state dir. A killed client falls silent, so the coordinator drops it from the round and
re-queues its sequences; the restarted client rejoins, restores its error feedback and
replays the updates since its checkpoint. A restarted server resumes from the run directory
and the clients reconnect.

With ``links`` (``--netns``, local_testnet/netns.py) each child runs in a network namespace
of its own, over a real link to one bridge, and ``cut`` (``--cut-link-at``) sets a member's
link down mid-upload: no process is killed, the connection goes half-open, and the
``CutRecord`` times, from the children's own lines, who noticed and when the member was back.
"""

from __future__ import annotations

import json
import re
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matformer.local_testnet.chaos import SERVER, ChaosEvent, ChaosRecord
from matformer.local_testnet.netns import Network
from matformer.local_testnet.processes import Child, child_env, python_module, say, wait_serving
from matformer.server.state import RunState

POLL_S = 0.5
CHAOS_POLL_S = 0.1  # while kills are pending: rounds of a small run take well under a second
SERVER_START_S = 60.0  # until the health service answers (first start builds round 0)
CLIENT_EXIT_S = 60.0  # clients leave on their own once the run finishes
RESTART_AFTER_S = 2.0  # --kill-client-at: from the kill to the restart
LOOPBACK = "127.0.0.1"
# a member's line for a round whose results were taken (client/progress.py)
TAKEN = re.compile(r"^round +\d+.*\(([1-9]\d*) results\)")


class TestnetFailed(RuntimeError):
    """A child died, or the run did not finish; the message holds its last log lines."""


@dataclass(kw_only=True)
class ClientSpec:
    name: str
    tier: int  # requested with --tier; the coordinator may assign another
    speed: float = 1.0  # --compute-speed: the fraction of this machine's speed it computes at
    port: int | None = None  # the relay it joins through (--relays); None: the root

    def describe(self) -> str:
        """Who it is and what it is asked: "member-0 (tier 0, at 0.5x this machine's speed)"."""
        return f"{self.name} (tier {self.tier}" + (
            f", at {self.speed:g}x this machine's speed)" if self.speed != 1 else ")")


@dataclass(frozen=True, slots=True)
class LinkCut:
    """Once ``round`` is open, ``target``'s link goes down when it next uploads, for
    ``seconds``."""

    round: int
    target: str
    seconds: float


@dataclass(kw_only=True)
class CutRecord:
    """What a link cut did: the seconds from the link going down until the coordinator
    dropped the member for silence and until the member said the coordinator does not
    answer; from the link coming back until the member's next results were taken."""

    cut: LinkCut
    round: int | None = None  # the round open when the link went down
    down_at: float | None = None  # time.monotonic()
    up_at: float | None = None
    coordinator_noticed_s: float | None = None
    member_noticed_s: float | None = None
    recovered_s: float | None = None

    def hear(self, name: str, line: str) -> None:
        """A child's line: the first of each kind after the cut is timed."""
        if self.down_at is None:
            return
        now = time.monotonic()
        if (name == "server" and self.coordinator_noticed_s is None
                and "silent for" in line and self.cut.target in line):
            self.coordinator_noticed_s = now - self.down_at
        elif name != self.cut.target:
            return
        if self.member_noticed_s is None and ("does not answer" in line
                                              or "heartbeat failed" in line):
            self.member_noticed_s = now - self.down_at
        if self.up_at is not None and self.recovered_s is None and TAKEN.search(line):
            self.recovered_s = now - self.up_at

    def summary(self) -> dict[str, Any]:
        """The record as summary.json keeps it (seconds to 0.1 s; None: not seen)."""
        seconds = {k: None if v is None else round(v, 1) for k, v in (
            ("coordinator_noticed_s", self.coordinator_noticed_s),
            ("member_noticed_s", self.member_noticed_s), ("recovered_s", self.recovered_s))}
        return {"target": self.cut.target, "round": self.round, "down_s": self.cut.seconds,
                "cut": self.down_at is not None, **seconds}


@dataclass(kw_only=True)
class TestnetPlan:
    config: Path  # run.toml
    overrides: list[str]  # matformer-server --set, ports included
    grpc_port: int
    http_port: int
    run_dir: Path
    clients: list[ClientSpec]
    latency_ms: float = 0.0
    busy_s: float = 0.0  # the slowed clients' busy and idle periods (0: always slowed)
    bandwidth_mbit: float = 0.0  # each client's upload and download limit; 0: none
    device: str | None = None  # the clients' --device; None: their default
    threads: int = 1  # each client's --threads
    events: list[ChaosEvent] = field(default_factory=list)  # kills, in round order
    tls_ca: Path | None = None  # [tls] cert: what clients (and relays) trust
    tls_key: Path | None = None  # [tls] key: relays serve their clients with the same pair
    env: dict[str, str] = field(default_factory=dict)  # the join token, for every child
    relay_env: dict[str, str] = field(default_factory=dict)  # the coordinator's and relays'
    relay_ports: list[int] = field(default_factory=list)  # one relay each (--relays)
    links: Network | None = None  # --netns: each child in a namespace of its own on it
    link_rate_mbit: float = 0.0  # --link-rate: each member's link, each way; 0: no limit
    cut: LinkCut | None = None  # --cut-link-at (with links)

    @property
    def relay_names(self) -> list[str]:
        return [f"relay-{index}" for index in range(len(self.relay_ports))]


class Testnet:
    def __init__(self, plan: TestnetPlan) -> None:
        self.plan = plan
        self.server: Child | None = None
        self.clients: dict[str, Child] = {}
        self.relays: dict[str, Child] = {}
        self.tiers_seen: dict[str, int] = {}  # client name → tier the coordinator gave it
        self.status: dict[str, Any] = {}
        self.chaos = ChaosRecord()
        self._events = list(plan.events)
        self._armed_at: float | None = None  # when the next event fires
        self._down: tuple[str, float] | None = None  # (killed target, restart time)
        self._restarted: tuple[float, int] | None = None  # server: (restart time, its round)
        self._started = time.monotonic()
        self.cut = CutRecord(cut=plan.cut) if plan.cut is not None else None
        self._cutter: threading.Thread | None = None
        self._stopping = threading.Event()

    # -- the run --------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        say("[testnet] starting the server")
        self._start_server()
        for name, port in zip(self.plan.relay_names, self.plan.relay_ports, strict=True):
            self._start_relay(name, port)
        for spec in self.plan.clients:
            self._start_client(spec)
        while True:
            self._check_children()
            self.status = self._poll() or self.status
            for member in self.status.get("clients", []):
                self.tiers_seen[member["name"]] = member["tier"]
            self._time_restart()
            if self.status.get("phase") == "finished":
                say(f"[testnet] the run finished after {self.status.get('round')} rounds; "
                    "waiting for the clients to leave")
                break
            self._chaos_step()
            self._cut_step()
            time.sleep(CHAOS_POLL_S if self._events or self._down else POLL_S)
        self.chaos.skipped = list(self._events)
        self._wait_for_clients()
        return self.status

    @property
    def http_base(self) -> str:
        scheme = "https" if self.plan.tls_ca is not None else "http"
        return f"{scheme}://{self._host('server')}:{self.plan.http_port}"

    @property
    def survivors(self) -> list[str]:
        """Clients running at the end (a client still down when the run ended is not)."""
        down = self._down[0] if self._down is not None else None
        return [spec.name for spec in self.plan.clients if spec.name != down]

    def stop_members(self) -> None:
        """Clients and relays (they leave the run; a relay writes its summary)."""
        for child in [*self.clients.values(), *self.relays.values()]:
            child.stop()

    def stop(self) -> None:
        """Clients first (they leave the run), then the server (it saves its state)."""
        self.stop_members()
        if self.server is not None:
            self.server.stop()
        self._stopping.set()
        if self._cutter is not None:
            self._cutter.join()  # the link comes back before the network goes

    # -- where children live --------------------------------------------------------------

    def _host(self, name: str) -> str:
        """The address ``name`` (the server, a relay) is reached at."""
        return LOOPBACK if self.plan.links is None else self.plan.links.address(name)

    def _placed(self, name: str, argv: list[str], rate_mbit: float) -> list[str]:
        """``argv`` as ``name`` runs it: in its own namespace with ``links``, its link made
        at ``rate_mbit`` on its first start and kept across restarts."""
        links = self.plan.links
        if links is None:
            return argv
        if name not in links.nodes:
            links.add(name, rate_mbit=rate_mbit)
        return links.wrap(name, argv)

    def _child(self, name: str, argv: list[str], on_line: Callable[[str], None] | None = None,
               *, rate_mbit: float = 0.0) -> Child:
        """``name``'s process, placed; ``on_line`` and the link cut's record hear its lines.
        Only a client's link has a rate: the coordinator's and the relays' stand for a data
        centre's."""
        cut = self.cut

        def heard(line: str) -> None:
            if on_line is not None:
                on_line(line)
            if cut is not None:
                cut.hear(name, line)

        # the relay token for the coordinator and the relays alone
        env = child_env({**self.plan.env, **self.plan.relay_env})
        if name != "server" and name not in self.plan.relay_names:
            env = {k: v for k, v in env.items() if k not in self.plan.relay_env}
        return Child.start(name, self._placed(name, argv, rate_mbit), env=env, on_line=heard)

    # -- children -------------------------------------------------------------------------

    def _start_server(self) -> None:
        p = self.plan
        argv = python_module("matformer.server.main", "--config", str(p.config),
                             *(arg for o in p.overrides for arg in ("--set", o)))
        self.server = self._child("server", argv)
        address = f"{self._host('server')}:{p.grpc_port}"
        try:
            wait_serving(address, self.server, SERVER_START_S, tls_ca=p.tls_ca)
        except RuntimeError as err:
            raise TestnetFailed(str(err)) from None
        say(f"[testnet] the server answers on {address} (gRPC); watch the run at {self.http_base}/")

    def _start_relay(self, name: str, port: int) -> None:
        """A relay between the root and the clients that join through ``port``."""
        p = self.plan
        argv = python_module("matformer.relay.main", "--upstream",
                             f"{self._host('server')}:{p.grpc_port}",
                             "--port", str(port), "--name", name,
                             "--dir", str(p.run_dir / "relays" / name),
                             # its clients all ready before it takes the root's first round
                             "--min-members", str(sum(c.port == port for c in p.clients)))
        if p.tls_ca is not None:  # TLS to the root, and to its clients with the root's pair
            argv += ["--tls-ca", str(p.tls_ca), "--tls-cert", str(p.tls_ca),
                     "--tls-key", str(p.tls_key)]
        if p.links is not None:  # its members dial its namespace's address
            argv += ["--host", "0.0.0.0"]
        self.relays[name] = self._child(name, argv)
        try:
            wait_serving(f"{self._host(name)}:{port}", self.relays[name], SERVER_START_S,
                         tls_ca=p.tls_ca)
        except RuntimeError as err:
            raise TestnetFailed(str(err)) from None
        say(f"[testnet] {name} relays between the root and the clients on "
            f"{self._host(name)}:{port}")

    def _start_client(self, spec: ClientSpec, *, restarted: bool = False) -> None:
        p = self.plan
        upstream = ("server" if spec.port is None
                    else f"relay-{p.relay_ports.index(spec.port)}")
        argv = python_module(
            "matformer.client.cli", "train", "--server",
            f"{self._host(upstream)}:{spec.port if spec.port is not None else p.grpc_port}",
            "--tier", str(spec.tier), "--name", spec.name,
            "--state-dir", str(p.run_dir / "clients" / spec.name), "--no-progress")
        if spec.speed != 1:
            argv += ["--compute-speed", str(spec.speed)]
            if p.busy_s:
                argv += ["--busy-s", str(p.busy_s)]
        if p.latency_ms:
            argv += ["--latency-ms", str(p.latency_ms)]
        if p.bandwidth_mbit:
            argv += ["--bandwidth-mbit", str(p.bandwidth_mbit)]
        if p.tls_ca is not None:
            argv += ["--tls-ca", str(p.tls_ca)]
        if p.device is not None:
            argv += ["--device", p.device]
        if p.threads != 1:  # one is what every child's OMP_NUM_THREADS gives
            argv += ["--threads", str(p.threads)]

        def announce_rejoin(line: str) -> None:
            if line.startswith("joined as "):
                say(f"[testnet] {spec.name} rejoined the run: {line}")
            elif "catching up from round" in line:
                say(f"[testnet] {spec.name} catches up: {line}")

        if not restarted:
            say(f"[testnet] starting {spec.describe()}")
        # the prefix is the member's name: the one its --name gives the coordinator
        self.clients[spec.name] = self._child(spec.name, argv,
                                              announce_rejoin if restarted else None,
                                              rate_mbit=p.link_rate_mbit)

    # -- chaos ------------------------------------------------------------------------------

    def _chaos_step(self) -> None:
        """Restart what is down once its time comes; fire the next event once its round is
        open and its delay has passed."""
        now = time.monotonic()
        if self._down is not None:
            if now >= self._down[1]:
                self._restart(self._down[0])
            return
        if not self._events or self.status.get("phase") != "collecting":
            return
        event = self._events[0]
        if self.status.get("round", -1) < event.round:
            return
        if self._armed_at is None:
            self._armed_at = now + event.delay_s
        if now >= self._armed_at:
            self._events.pop(0)
            self._armed_at = None
            self._kill(event)

    def _cut_step(self) -> None:
        """Once the cut's round is open: a thread of its own waits for the member's upload
        and cuts its link."""
        if self.cut is None or self._cutter is not None or self.status.get(
                "phase") != "collecting" or self.status.get("round", -1) < self.cut.cut.round:
            return
        self._cutter = threading.Thread(target=self._cut_link, name="link-cut", daemon=True)
        self._cutter.start()

    def _cut_link(self) -> None:
        record, links = self.cut, self.plan.links
        target, seconds = record.cut.target, record.cut.seconds
        while not links.wait_for_upload(target, wait_s=1.0):
            if self._stopping.is_set():
                return
        record.round = self.status.get("round")
        say(f"[testnet] {target}'s link goes down mid-upload in round {record.round} for "
            f"{seconds:g} s: no FIN, no RST, its connections are half-open")
        record.down_at = time.monotonic()
        links.down(target, seconds=seconds)
        record.up_at = time.monotonic()
        say(f"[testnet] {target}'s link is up again")

    def _time_restart(self) -> None:
        """Once a restarted server has completed a round: how long that took."""
        if self._restarted is not None and self.status.get("round", -1) > self._restarted[1]:
            seconds = time.monotonic() - self._restarted[0]
            self.chaos.restart_to_round_s.append(round(seconds, 1))
            say(f"[testnet] the restarted server completed round {self._restarted[1]} "
                f"{seconds:.1f} s after it was started again")
            self._restarted = None

    def _kill(self, event: ChaosEvent) -> None:
        child = self.server if event.target == SERVER else self.clients[event.target]
        child.kill()
        self._down = (event.target, time.monotonic() + event.down_s)
        self.chaos.kills.append({"target": event.target, "round": self.status.get("round"),
                                 "at_s": round(time.monotonic() - self._started, 1)})
        if event.target == SERVER:
            say(f"[testnet] killed the server (SIGKILL) in round {self.status['round']}; "
                f"restarting it in {event.down_s:.1f} s with the same command")
        else:
            say(f"[testnet] killed {event.target} (SIGKILL) in round {self.status['round']}; "
                "it falls silent, so the coordinator drops it from the round and re-queues "
                "its sequences")

    def _restart(self, target: str) -> None:
        self._down = None
        if target == SERVER:
            saved = RunState.load(self.plan.run_dir)
            started = time.monotonic()
            say(f"[testnet] restarting the server; it resumes at round {saved.round}")
            self._start_server()
            self._restarted = (started, saved.round)
            return
        spec = next(s for s in self.plan.clients if s.name == target)
        say(f"[testnet] restarting {spec.name} with the same name and state dir "
            f"{self.plan.run_dir / 'clients' / spec.name}")
        self._start_client(spec, restarted=True)

    def _check_children(self) -> None:
        """TestnetFailed when the server or a client (not the one killed) exited badly."""
        down = self._down[0] if self._down is not None else None
        if self.server is not None and not self.server.alive and down != SERVER:
            raise TestnetFailed(f"the server exited with code {self.server.returncode}; its "
                                f"last lines:\n{self.server.tail()}")
        for name, child in [*self.clients.items(), *self.relays.items()]:
            if name != down and child.returncode not in (None, 0):
                raise TestnetFailed(f"{name} exited with code {child.returncode}; its last "
                                    f"lines:\n{child.tail()}")

    def _wait_for_clients(self) -> None:
        """The clients, then the relays, leave once the run finished."""
        deadline = time.monotonic() + CLIENT_EXIT_S
        for name, child in [*self.clients.items(), *self.relays.items()]:
            if self._down is not None and name == self._down[0]:
                continue  # killed, and the run ended before its restart
            if not child.wait(max(deadline - time.monotonic(), 0.1)):
                say(f"[testnet] {name} did not leave within {CLIENT_EXIT_S:.0f} s; stopping it")
                child.stop()
            elif child.returncode != 0:
                raise TestnetFailed(f"{name} exited with code {child.returncode}; its last "
                                    f"lines:\n{child.tail()}")

    def _poll(self) -> dict[str, Any] | None:
        url = f"{self.http_base}/status"
        context = (ssl.create_default_context(cafile=str(self.plan.tls_ca))
                   if self.plan.tls_ca is not None else None)
        try:
            with urllib.request.urlopen(url, timeout=5, context=context) as reply:
                return json.load(reply)
        except (urllib.error.URLError, OSError, json.JSONDecodeError):
            return None  # busy or not yet up: the next poll asks again
