"""The testnet's children: the server and the clients, each a process whose output is
streamed line by line with a prefix, its name (``[server] ...``, ``[member-0] ...``).

    child = Child.start("server", [sys.executable, "-m", "matformer.server.main", ...], env=env)
    child.alive, child.returncode, child.tail()   # the last lines it printed
    child.stop()                                  # SIGTERM, then SIGKILL after a grace period
"""

from __future__ import annotations

import collections
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from matformer.protocol.channel import open_channel

TAIL_LINES = 30  # lines of a child's output kept to show when it fails
# Children share two cores: one thread each keeps them from oversubscribing the CPU.
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}

_print_lock = threading.Lock()


def say(line: str) -> None:
    """One line of the testnet's own output, never interleaved with a child's."""
    with _print_lock:
        print(line, flush=True)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (bound, read, released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, **CHILD_ENV, **(extra or {})}


@dataclass(kw_only=True)
class Child:
    name: str  # the log prefix
    process: subprocess.Popen
    lines: collections.deque = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    on_line: Callable[[str], None] | None = None  # sees every line (after it is printed)
    _reader: threading.Thread | None = None

    @classmethod
    def start(cls, name: str, argv: list[str], *, env: dict[str, str],
              on_line: Callable[[str], None] | None = None) -> Child:
        process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   text=True, bufsize=1, start_new_session=True)
        child = cls(name=name, process=process, on_line=on_line)
        child._reader = threading.Thread(target=child._stream, name=f"log-{name}", daemon=True)
        child._reader.start()
        return child

    def _stream(self) -> None:
        for raw in self.process.stdout:
            line = raw.rstrip("\n")
            self.lines.append(line)
            say(f"[{self.name}] {line}")
            if self.on_line is not None:
                self.on_line(line)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.process.poll()

    def tail(self) -> str:
        return "\n".join(f"    {line}" for line in self.lines)

    def kill(self) -> None:
        """SIGKILL: the crash the fault injection simulates."""
        if self.alive:
            self.process.kill()
        self.process.wait()
        self.join_output()

    def stop(self, grace_s: float = 10.0) -> int:
        """SIGTERM (servers save, clients leave the run), SIGKILL after ``grace_s``."""
        if self.alive:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(grace_s)
            except subprocess.TimeoutExpired:
                say(f"[testnet] {self.name} did not stop within {grace_s:.0f} s; killing it")
                self.process.kill()
                self.process.wait()
        self.join_output()
        return self.process.returncode

    def wait(self, timeout_s: float) -> bool:
        """True when the child exited within ``timeout_s``."""
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return False
        self.join_output()
        return True

    def join_output(self) -> None:
        if self._reader is not None:
            self._reader.join(timeout=5)


def wait_serving(address: str, server: Child, timeout_s: float, *,
                 tls_ca: Path | None = None) -> None:
    """Return once the gRPC health service at ``address`` answers SERVING; RuntimeError when
    ``server`` exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    channel = open_channel(address, tls_ca=tls_ca, options=())
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if not server.alive:
                raise RuntimeError(f"the server exited with code {server.returncode} before "
                                   f"serving:\n{server.tail()}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise RuntimeError(f"the server did not answer on {address} within {timeout_s:.0f} s:\n"
                       f"{server.tail()}")


def python_module(module: str, *args: str) -> list[str]:
    """argv running ``python -m module args`` with this interpreter."""
    return [sys.executable, "-m", module, *args]
