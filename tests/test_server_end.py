"""What ``matformer-server`` says while its run goes and when it ends (issue 32, row 6): a
line per closed round, a summary once the run is finished, then an exit (code 0) once its
members have left, unless ``[server] stay_after_finish``."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys

from support.helpers import JOIN_TOKEN, TESTNET_MODEL, Clock, run_config, served_run_toml
from support.rounds import caps, drive

from matformer.local_testnet.processes import free_port
from matformer.server.coordinator import Coordinator
from matformer.server.run_end import RunEnd

EXIT_S = 180  # generous: two processes share two cores; a hang fails, never a slow run


def test_each_round_is_a_line_and_the_end_waits_for_the_members(tmp_path, mdat_path,
                                                                  caplog):
    caplog.set_level(logging.INFO, logger="matformer.server")
    clock = Clock()
    c = Coordinator(run_config(tmp_path / "run", mdat_path, rounds=2), clock=clock)
    cid = c.join(caps("alice", tier=1))[0].client_id
    end, stays = RunEnd.of(c, stay=False), RunEnd.of(c, stay=True)
    drive(c, clock, cid, 1)
    assert not end.reached()  # a run that goes on
    drive(c, clock, cid, 1)
    said = [r.getMessage() for r in caplog.records]
    closed = [line for line in said if " closed (" in line]
    first, second = (r["tokens"] for r in c.state.rounds)  # the fake clock: 1 s a round
    assert closed == [f"round 0 closed (1 of 2 rounds done): {first:,} tokens from alice in "
                      "1.00 s; loss tier 1 1.000",
                      f"round 1 closed (2 of 2 rounds done): {second:,} tokens from alice in "
                      "1.00 s; loss tier 1 1.000"]
    assert not end.reached()  # alice is still fetching the last update
    summary = [line for line in (r.getMessage() for r in caplog.records)
               if line.startswith("the run is finished: ")]
    assert len(summary) == 1, summary
    checkpoint = tmp_path / "run" / "checkpoints" / "round-2"
    assert summary[0] == (f"the run is finished: 2 rounds, {first + second:,} tokens in 2 s; "
                          "members alice; last training loss tier 1 1.000; final checkpoint "
                          f"{checkpoint}")
    clock.now += c.config.faults.heartbeat_timeout_s + 1  # alice vanished without leaving
    assert end.reached()
    c.leave(cid)
    assert end.reached() and not stays.reached()  # stay_after_finish: serve on


def test_the_server_exits_once_its_finished_run_is_left_and_says_so_again(tmp_path):
    """A real server and client: two rounds, the server's lines, its exit with code 0 after
    the client left; started again on the finished run, it says so and exits too."""
    config = served_run_toml(tmp_path, min_clients=1, model={"inline": TESTNET_MODEL},
                             round={"min_clients": 1, "deadline_s": 60.0,
                                    "tokens_per_round": 1024, "rounds": 2})
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ports = [f"server.grpc_port={free_port()}", f"server.http_port={free_port()}"]
    server_argv = [sys.executable, "-m", "matformer.server.main", "--config", str(config),
                   *(arg for o in ports for arg in ("--set", o))]
    server = subprocess.Popen(server_argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    client = subprocess.Popen(
        [sys.executable, "-m", "matformer.client.cli", "train", "--server",
         f"127.0.0.1:{ports[0].split('=')[1]}", "--join-token", JOIN_TOKEN, "--name", "solo",
         "--state-dir", str(tmp_path / "solo"), "--no-progress"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        said, _ = server.communicate(timeout=EXIT_S)
        heard, _ = client.communicate(timeout=EXIT_S)
    finally:
        for process in (server, client):
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
    assert client.returncode == 0, heard
    assert "matformer-client: solo trained 2 rounds at tier 0" in heard, heard
    assert server.returncode == 0, said
    assert re.search(r"round 0 closed \(1 of 2 rounds done\): [\d,]+ tokens from solo in "
                     r"[\d.]+ s; loss tier 0 [\d.]+\n", said), said
    assert re.search(r"round 1 closed \(2 of 2 rounds done\): [\d,]+ tokens from solo in ",
                     said), said
    assert re.search(r"the run is finished: 2 rounds, [\d,]+ tokens in \d+ s; members solo; "
                     r"last training loss tier 0 [\d.]+; final checkpoint \S+round-2\n", said)
    assert "every member has left" in said, said
    assert said.index("leave solo (client-0): finished") < said.index("every member has left")

    again = subprocess.run(server_argv, cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=EXIT_S)
    assert again.returncode == 0, again.stderr
    assert "the run finished after 2 rounds" in again.stderr, again.stderr
    assert "the run is finished: 2 rounds, " in again.stderr, again.stderr
