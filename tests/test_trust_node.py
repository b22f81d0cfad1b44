"""A torchrun node (2 Gloo ranks, one participant) against a real coordinator on loopback:
its ranks leave when rank 0 is stopped, and stay while rank 0 waits on the coordinator."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from support.helpers import JOIN_TOKEN, run_tables, write_run_toml

from matformer.client.federated import FederatedClient, FederatedOptions
from matformer.modeling.mdat import build_default_mdat
from matformer.server.config import RunConfig
from matformer.server.main import RunningServer

ROOT = Path(__file__).parent.parent
SILENT = "rank 0 of this node has shown no sign of life"


@pytest.fixture(scope="module")
def mdat(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "docs.mdat"
    build_default_mdat(path, limit=60).close()
    return path


def serve(tmp_path: Path, mdat: Path, **round_: float) -> RunningServer:
    tables = run_tables(mdat, run={"id": "node", "dir": "run"}, tiers={"allowed": [0]},
                        round={"min_clients": 1, "deadline_s": 300.0,
                               "tokens_per_round": 1024, **round_})
    return RunningServer.start(RunConfig.load(write_run_toml(tmp_path / "run.toml", tables)),
                               grpc_port=0, http_port=0)


def start_node(server: RunningServer, tmp_path: Path, *options: str) -> subprocess.Popen:
    """``torchrun`` with 2 CPU ranks as the client "node"; its output in tmp_path/node.*."""
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "matformer.client.cli", "train", "--server", f"127.0.0.1:{server.grpc_port}",
         "--join-token", JOIN_TOKEN, "--name", "node", "--tier", "0",
         "--microbatch-tokens", "256", "--state-dir", str(tmp_path / "node"), "--no-progress",
         *options],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=(tmp_path / "node.out").open("w"), stderr=(tmp_path / "node.err").open("w"))


def wait_for(condition, what: str, node: subprocess.Popen, timeout_s: float = 300) -> None:
    give_up = time.monotonic() + timeout_s
    while not condition():
        assert node.poll() is None, f"the node ended (rc {node.returncode}) before {what}"
        assert time.monotonic() < give_up, f"no {what} within {timeout_s:g} s"
        time.sleep(0.2)


def ranks(torchrun: int) -> dict[int, int]:
    """The pids of torchrun's workers, by rank."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent == torchrun:
                environ = (stat.parent / "environ").read_bytes().split(b"\0")
                rank = next(int(v[5:]) for v in environ if v.startswith(b"RANK="))
                found[rank] = int(stat.parent.name)
        except (OSError, StopIteration):
            continue  # a process that ended meanwhile, or one that is no rank
    return found


def running(pid: int) -> bool:
    """Whether ``pid`` runs (exists and is no zombie)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def end(node: subprocess.Popen, pids: list[int]) -> None:
    for pid in pids:
        if running(pid):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)
    if node.poll() is None:
        node.kill()
    node.wait(timeout=60)


def test_a_follower_leaves_within_the_bound_when_rank_0_stops(tmp_path, mdat):
    """Rank 0 stopped (SIGSTOP: its process stays, so no connection breaks) while the node
    trains: rank 1 leaves within the bound with a line naming rank 0, rather than wait
    inside a collective for Gloo's 30 minutes."""
    server = serve(tmp_path, mdat, rounds=50)
    node = start_node(server, tmp_path, "--rank-timeout-s", "10")
    pids: dict[int, int] = {}
    try:
        wait_for(lambda: server.service.coordinator.state.round >= 1, "trained round", node)
        pids = ranks(node.pid)
        assert sorted(pids) == [0, 1]
        os.kill(pids[0], signal.SIGSTOP)
        stopped = time.monotonic()
        while running(pids[1]) and time.monotonic() - stopped < 60:
            time.sleep(0.2)
        assert not running(pids[1]), "rank 1 still runs 60 s after rank 0 stopped"
        assert running(pids[0]) or node.poll() is not None
    finally:
        end(node, list(pids.values()))
        server.stop()
    errors = (tmp_path / "node.err").read_text()
    line = next((line for line in errors.splitlines() if SILENT in line), None)
    assert line is not None, errors[-3000:]
    assert "--rank-timeout-s" in line


def test_a_node_waiting_on_the_coordinator_longer_than_the_bound_is_not_cut(tmp_path, mdat):
    """The run opens its first round only when a second member joins, 15 s (5 bounds) after
    the node is ready: the follower waits for rank 0's next message all that time, and the
    node trains the run to its end with every rank."""
    server = serve(tmp_path, mdat, rounds=2, min_clients=2)
    node = start_node(server, tmp_path, "--rank-timeout-s", "3")
    other = FederatedClient(FederatedOptions(
        server=f"127.0.0.1:{server.grpc_port}", name="other", join_token=JOIN_TOKEN,
        state_dir=tmp_path / "other", microbatch_tokens=256, progress=False))
    joining = threading.Thread(target=other.run)
    try:
        wait_for(lambda: "measured" in (tmp_path / "node.out").read_text(), "speed probe",
                 node)
        time.sleep(15)
        assert node.poll() is None, (tmp_path / "node.err").read_text()[-3000:]
        joining.start()
        node.wait(timeout=300)
        joining.join(timeout=300)
    finally:
        end(node, [])
        server.stop()
    errors = (tmp_path / "node.err").read_text()
    assert node.returncode == 0, errors[-3000:]
    assert SILENT not in errors
    summary = json.loads((tmp_path / "node" / "summary.json").read_text())
    assert summary["finished"] and summary["rounds_trained"] == 2
    assert summary["world_size"] == 2 and len(set(summary["rank_hashes"])) == 1
