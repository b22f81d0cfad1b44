"""One coordinator and N clients as processes on loopback, watched until the run finishes.

    net = Testnet(plan)
    status = net.run()   # the final /status JSON; TestnetFailed when a child dies
    net.stop()           # always: stops whatever is still running

The server is ``python -m server.main --config run.toml --set ...``; each client is
``python -m client.cli train --server 127.0.0.1:PORT ...`` with its own state dir. The
testnet polls ``GET /status`` to follow the run, and with ``kill_client_at`` it SIGKILLs the
last client once that round is open, then restarts it under the same name and state dir: the
round closes at its deadline with the others, the killed client's sequences go back to the
queue, and the restarted client rejoins, loads the checkpoint and replays the updates since.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from local_testnet.processes import Child, child_env, python_module, say, wait_serving

POLL_S = 0.5
SERVER_START_S = 60.0  # until the health service answers (first start builds round 0)
CLIENT_EXIT_S = 60.0  # clients leave on their own once the run finishes
RESTART_AFTER_S = 2.0


class TestnetFailed(RuntimeError):
    """A child died, or the run did not finish; the message holds its last log lines."""


@dataclass(kw_only=True)
class ClientSpec:
    name: str
    tier: int  # requested with --tier; the coordinator may assign another

    @property
    def prefix(self) -> str:
        return f"{self.name} t{self.tier}"


@dataclass(kw_only=True)
class TestnetPlan:
    config: Path  # run.toml
    overrides: list[str]  # matformer-server --set, ports included
    grpc_port: int
    http_port: int
    run_dir: Path
    clients: list[ClientSpec]
    latency_ms: float = 0.0
    kill_client_at: int | None = None
    tls_ca: Path | None = None
    env: dict[str, str] = field(default_factory=dict)  # the join token, for every child


class Testnet:
    def __init__(self, plan: TestnetPlan) -> None:
        self.plan = plan
        self.server: Child | None = None
        self.clients: dict[str, Child] = {}
        self.tiers_seen: dict[str, int] = {}  # client name → tier the coordinator gave it
        self.status: dict[str, Any] = {}
        self._killed: str | None = None  # the client killed on purpose, until restarted

    # -- the run --------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self._start_server()
        for spec in self.plan.clients:
            self._start_client(spec)
        killed_at: float | None = None
        while True:
            self._check_children()
            self.status = self._poll() or self.status
            for member in self.status.get("clients", []):
                self.tiers_seen[member["name"]] = member["tier"]
            if self.status.get("phase") == "finished":
                break
            kill_at = self.plan.kill_client_at
            if (kill_at is not None and killed_at is None and self._killed is None
                    and self.status.get("round", -1) >= kill_at
                    and self.status.get("phase") == "collecting"):
                killed_at = time.monotonic()
                self._kill_last_client()
            if self._killed is not None and time.monotonic() - killed_at >= RESTART_AFTER_S:
                self._restart_killed()
            time.sleep(POLL_S)
        self._wait_for_clients()
        return self.status

    def stop(self) -> None:
        """Clients first (they leave the run), then the server (it saves its state)."""
        for child in self.clients.values():
            child.stop()
        if self.server is not None:
            self.server.stop()

    # -- children -------------------------------------------------------------------------

    def _start_server(self) -> None:
        p = self.plan
        argv = python_module("server.main", "--config", str(p.config),
                             *(arg for o in p.overrides for arg in ("--set", o)))
        self.server = Child.start("server", argv, env=child_env(p.env))
        address = f"127.0.0.1:{p.grpc_port}"
        try:
            wait_serving(address, self.server, SERVER_START_S, tls_ca=p.tls_ca)
        except RuntimeError as err:
            raise TestnetFailed(str(err)) from None
        say(f"[testnet] the server answers on {address} (gRPC) and "
            f"http://127.0.0.1:{p.http_port}/status")

    def _start_client(self, spec: ClientSpec, *, restarted: bool = False) -> None:
        p = self.plan
        argv = python_module(
            "client.cli", "train", "--server", f"127.0.0.1:{p.grpc_port}",
            "--tier", str(spec.tier), "--name", spec.name,
            "--state-dir", str(p.run_dir / "clients" / spec.name), "--no-progress")
        if p.latency_ms:
            argv += ["--latency-ms", str(p.latency_ms)]
        if p.tls_ca is not None:
            argv += ["--tls-ca", str(p.tls_ca)]

        def announce_rejoin(line: str) -> None:
            if line.startswith("joined as "):
                say(f"[testnet] {spec.name} rejoined the run: {line}")
            elif "catching up from round" in line:
                say(f"[testnet] {spec.name} catches up: {line}")

        self.clients[spec.name] = Child.start(spec.prefix, argv, env=child_env(p.env),
                                              on_line=announce_rejoin if restarted else None)

    def _kill_last_client(self) -> None:
        spec = self.plan.clients[-1]
        self.clients[spec.name].kill()
        self._killed = spec.name
        say(f"[testnet] killed {spec.name} (SIGKILL) in round {self.status['round']}; the "
            f"round closes at its deadline without it and its sequences are re-queued")

    def _restart_killed(self) -> None:
        spec = next(s for s in self.plan.clients if s.name == self._killed)
        self._killed = None
        say(f"[testnet] restarting {spec.name} with the same name and state dir "
            f"{self.plan.run_dir / 'clients' / spec.name}")
        self._start_client(spec, restarted=True)

    def _check_children(self) -> None:
        """TestnetFailed when the server or a client (not the one killed) exited badly."""
        if self.server is not None and not self.server.alive:
            raise TestnetFailed(f"the server exited with code {self.server.returncode}; its "
                                f"last lines:\n{self.server.tail()}")
        for name, child in self.clients.items():
            if name != self._killed and child.returncode not in (None, 0):
                raise TestnetFailed(f"{name} exited with code {child.returncode}; its last "
                                    f"lines:\n{child.tail()}")

    def _wait_for_clients(self) -> None:
        deadline = time.monotonic() + CLIENT_EXIT_S
        for name, child in self.clients.items():
            if not child.wait(max(deadline - time.monotonic(), 0.1)):
                say(f"[testnet] {name} did not leave within {CLIENT_EXIT_S:.0f} s; stopping it")
                child.stop()
            elif child.returncode != 0:
                raise TestnetFailed(f"{name} exited with code {child.returncode}; its last "
                                    f"lines:\n{child.tail()}")

    def _poll(self) -> dict[str, Any] | None:
        url = f"http://127.0.0.1:{self.plan.http_port}/status"
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                return json.load(reply)
        except (urllib.error.URLError, OSError, json.JSONDecodeError):
            return None  # busy or not yet up: the next poll asks again
