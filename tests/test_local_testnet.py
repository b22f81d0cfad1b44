"""local-testnet: the report (table, plot, summary), matformer-server's ``--set`` overrides,
and one end-to-end run with a client killed and restarted mid-run."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch
from support.certs import self_signed
from support.helpers import TESTNET_MODEL, local_testnet_toml, run_testnet

from matformer.client.federated import speed_at
from matformer.local_testnet import testnet as testnets  # its classes are not tests
from matformer.local_testnet.chaos import SERVER, chaos_plan, check_run
from matformer.local_testnet.default_run import write_default_run
from matformer.local_testnet.main import main as local_testnet_main
from matformer.local_testnet.main import parse_args, set_aside, token_env
from matformer.local_testnet.report import (
    format_table,
    moved_mib,
    tier_reports,
    training_curves,
    write_plot,
    write_summary,
)
from matformer.modeling.commands import apply_overrides
from matformer.modeling.folder_lock import locked
from matformer.modeling.mdat import build_default_mdat
from matformer.server.config import RunConfig
from matformer.server.errors import InvalidValue, UnknownKey, WrongType
from matformer.server.held_out_log import HeldOutLog
from matformer.server.main import main as server_main

REPO = Path(__file__).resolve().parents[1]

STATUS = {
    "run_id": "t", "phase": "finished", "round": 3, "tokens": 3000, "checkpoints": [0, 3],
    "clients": [],
    "loss": {"0": [{"round": 0, "loss": 5.5}, {"round": 2, "loss": 4.0},
                   {"round": 1, "loss": 4.5}],
             "1": [{"round": 0, "loss": 5.6}, {"round": 1, "loss": 4.9}]},
    "bytes_received": {"0": 2048, "1": 4096, "2": 1024},
    "bytes_dense": {"0": 65536, "1": 131072, "2": 32768},
}


# -- report ----------------------------------------------------------------------------------

def reports():
    return tier_reports(STATUS, clients={0: 2, 1: 1}, initial={0: 5.6, 1: 5.6, 2: 5.6},
                        final={0: 4.1, 1: 4.2, 2: 5.7})


def test_training_curves_are_in_round_order():
    assert training_curves(STATUS)[0] == [(0, 5.5), (1, 4.5), (2, 4.0)]


def test_tier_reports_take_first_and_last_round_and_held_out():
    by_tier = {r.tier: r for r in reports()}
    assert sorted(by_tier) == [0, 1, 2]
    assert (by_tier[0].clients, by_tier[0].first_round_loss, by_tier[0].last_round_loss) == (
        2, 5.5, 4.0)
    assert (by_tier[1].held_out_initial, by_tier[1].held_out_final) == (5.6, 4.2)
    assert by_tier[0].improved and not by_tier[2].improved
    assert by_tier[2].clients == 0 and math.isnan(by_tier[2].first_round_loss)


def test_table_has_a_row_per_tier():
    lines = format_table(reports()).splitlines()
    assert lines[0].split(" | ")[0] == "tier" and "held-out loss" in lines[0]
    assert set(lines[1]) <= {"-", "+"}
    row0 = [cell.strip() for cell in lines[2].split("|")]
    assert row0 == ["0", "2", "5.500", "4.000", "5.600 → 4.100"]
    assert [line.split("|")[0].strip() for line in lines[2:]] == ["0", "1", "2"]


def test_plot_is_a_png(tmp_path):
    path = write_plot(STATUS, tmp_path / "loss.png")
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000


def test_the_plot_shows_what_each_client_moved_both_ways(tmp_path):
    costs = {"client-0": {"tier": 0, "bytes_up": 2**20, "bytes_down": 3 * 2**20,
                          "dense_bytes_up": 40 * 2**20, "dense_bytes_down": 60 * 2**20}}
    assert moved_mib(costs) == {"client-0": {"up": 1.0, "down": 3.0, "dense": 100.0}}
    plain = write_plot(STATUS, tmp_path / "plain.png").read_bytes()
    with_costs = write_plot(STATUS, tmp_path / "costs.png", costs).read_bytes()
    width = lambda png: int.from_bytes(png[16:20], "big")  # noqa: E731 (the IHDR width)
    assert (width(plain), width(with_costs)) == (1100, 1600)  # a third panel, the costs


def test_plot_of_a_run_without_rounds(tmp_path):
    empty = {"run_id": "t", "loss": {}, "bytes_received": {}}
    assert write_plot(empty, tmp_path / "loss.png").read_bytes().startswith(b"\x89PNG")


def test_summary_holds_the_table_numbers(tmp_path):
    summary = json.loads(write_summary(tmp_path / "s.json", reports(), STATUS,
                                       wall_s=12.5).read_text())
    assert (summary["rounds"], summary["tokens"], summary["wall_s"]) == (3, 3000, 12.5)
    tier0, _, tier2 = summary["tiers"]
    assert tier0 == {"tier": 0, "clients": 2, "first_round_loss": 5.5, "last_round_loss": 4.0,
                     "held_out_initial": 5.6, "held_out_final": 4.1, "improved": True}
    assert tier2["first_round_loss"] is None and tier2["improved"] is False
    assert summary["loss"]["1"] == [[0, 5.6], [1, 4.9]]
    assert summary["bytes_received"] == {"0": 2048, "1": 4096, "2": 1024}
    assert summary["bytes_dense"] == {"0": 65536, "1": 131072, "2": 32768}


# -- matformer-server --set ------------------------------------------------------------------

def test_an_override_reads_toml_values_and_bare_words():
    assert apply_overrides({"round": {"rounds": 2}}, ["round.rounds=5", "tiers.allowed=[0, 1]",
                                                      'server.host="0.0.0.0"', "run.dir=runs/x"]
                           ) == {"round": {"rounds": 5}, "tiers": {"allowed": [0, 1]},
                                 "server": {"host": "0.0.0.0"}, "run": {"dir": "runs/x"}}
    with pytest.raises(InvalidValue, match=r"SECTION\.KEY=VALUE"):
        apply_overrides({}, ["rounds=5"])
    with pytest.raises(InvalidValue, match=r"SECTION\.KEY=VALUE"):
        apply_overrides({}, ["round.rounds"])
    with pytest.raises(InvalidValue, match="not a TOML value"):
        apply_overrides({}, ["run.id=my run"])


def test_override_takes_effect(tmp_path):
    path = local_testnet_toml(tmp_path / "run.toml")
    config = RunConfig.load(path, ["round.rounds=7", "server.grpc_port=7100",
                                "model.inline.hidden_size=64", 'run.dir="other"'])
    assert config.round.rounds == 7 and config.server.grpc_port == 7100
    assert config.model.build().hidden_size == 64
    assert config.run.dir == (tmp_path / "other").resolve()  # relative to the file, as in it
    assert RunConfig.load(path).round.rounds == 5


def test_typo_in_an_override_reads_like_a_typo_in_the_file(tmp_path):
    with pytest.raises(UnknownKey) as from_file:
        RunConfig.load(local_testnet_toml(tmp_path / "typo.toml", checkpoint={"evry_rounds": 2}))
    with pytest.raises(UnknownKey) as from_set:
        RunConfig.load(local_testnet_toml(tmp_path / "run.toml"), ["checkpoint.evry_rounds=2"])
    assert str(from_set.value) == str(from_file.value)
    assert "did you mean 'every_rounds'" in str(from_set.value)
    with pytest.raises(UnknownKey, match="valid keys: run, model"):
        RunConfig.load(local_testnet_toml(tmp_path / "run.toml"), ["rond.rounds=2"])
    with pytest.raises(WrongType, match=r"round\.rounds is not a table"):
        RunConfig.load(local_testnet_toml(tmp_path / "run.toml"), ["round.rounds.x=2"])


def test_server_refuses_a_bad_override_before_serving(tmp_path, capsys):
    path = local_testnet_toml(tmp_path / "run.toml")
    assert server_main(["--config", str(path), "--set", "round.roundz=3"]) == 2
    assert "has no key 'roundz'; did you mean 'rounds'?" in capsys.readouterr().err


def test_a_device_the_machine_lacks_stops_the_testnet_before_any_process(capsys):
    absent = f"cuda:{torch.cuda.device_count() + 7}"
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--device", absent])
    assert exit_info.value.code == 2
    assert f"error: device '{absent}'" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "message"), [
    (["--num-clients", "0"], "[testnet] num_clients must be >= 1, got 0."),
    (["--client-speeds", "1,2"], "--client-speeds takes fractions in (0, 1]"),
    (["--relays", "4", "--num-clients", "3"], "--relays must lie in [0, --num-clients]"),
    (["--latency-ms", "-1"], "[testnet] latency_ms must be >= 0"),
])
def test_the_testnets_flags_are_checked_by_their_declarations(capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_the_testnets_flags_read_as_declared():
    args = parse_args(["--tiers", "0,2", "--client-speeds", "1,0.5", "--no-eval", "--overlap"])
    assert (args.tiers, args.client_speeds, args.eval, args.overlap) == ([0, 2], [1.0, 0.5],
                                                                         False, True)
    assert parse_args([]).tiers == [0, 1, 2] and parse_args([]).eval


def test_a_busy_machine_is_slowed_every_other_period():
    """--busy-s: the clients --client-speeds slows compute at their fraction in the first
    period and every other one after, at full speed between (what late results are
    measured with, bench/README.md "Late results")."""
    assert parse_args(["--busy-s", "15"]).busy_s == 15.0 and parse_args([]).busy_s == 0.0
    assert [speed_at(0.25, 15.0, t) for t in (0.0, 14.9, 15.0, 29.9, 30.0, 46.0)] == [
        0.25, 0.25, 1.0, 1.0, 0.25, 1.0]
    assert speed_at(0.25, 0.0, 1e6) == 0.25 and speed_at(1.0, 15.0, 0.0) == 1.0


def test_a_second_testnet_in_a_running_ones_folder_is_refused(tmp_path, capsys):
    run_dir = tmp_path / "testnet"
    (run_dir / "checkpoints").mkdir(parents=True)
    with locked(tmp_path / ".testnet.lock", "pid 4242, started today"):
        assert local_testnet_main(["--run-dir", str(run_dir), "--rounds", "2"]) == 2
    err = capsys.readouterr().err
    assert f"another testnet is running in {run_dir} (pid 4242, started today)" in err
    assert "--run-dir DIR" in err
    assert (run_dir / "checkpoints").is_dir()  # the running one's files are untouched


def test_a_new_testnet_keeps_the_run_before_beside_it(tmp_path):
    run_dir = tmp_path / "testnet"
    for generation in ("oldest", "older"):
        run_dir.mkdir()
        (run_dir / "summary.json").write_text(generation)
        set_aside(run_dir)
    assert not run_dir.exists()
    assert (tmp_path / "testnet-previous" / "summary.json").read_text() == "older"


# -- end to end ------------------------------------------------------------------------------

@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlapped"])
def test_two_clients_with_one_killed_and_restarted(tmp_path, overlap, monkeypatch):
    build_default_mdat(tmp_path / "d.mdat", limit=150).close()
    # The restarted client proves its name with the session it saved, so the coordinator
    # hands its sequences back at once; the rounds then wait for it to be ready again
    # (min_clients = 2), behind a WAN's latency and a 20 Mbit/s link.
    config = local_testnet_toml(tmp_path / "run.toml", deadline=8.0, tokens=1024, rounds=8,
                                auth={"join_token_env": "TESTNET_JOIN_TOKEN"})
    env = {k: v for k, v in os.environ.items() if k != "TESTNET_JOIN_TOKEN"}
    result = run_testnet(
        [sys.executable, "-m", "matformer.local_testnet.main", "--num-clients", "2",
         "--tiers", "0,1", "--config", str(config), "--kill-client-at", "2", "--latency-ms", "150",
         "--bandwidth-mbit", "20", "--device", "cpu", "--eval-sequences", "5",
         *(["--overlap"] if overlap else [])],
        cwd=REPO, env=env, timeout=170)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    assert (checkpoints / "round-8" / "config.json").is_file()
    assert (checkpoints / "round-8" / "tier1" / "config.json").is_file()
    assert list(checkpoints.rglob("matformer_manifest.json"))
    assert (run / "loss.png").read_bytes().startswith(b"\x89PNG")
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds"] == 8 and all(t["improved"] for t in summary["tiers"])
    # the evaluations went to the run's held-out log too, which the dashboard draws
    held_out = HeldOutLog(run).points()
    assert {int(t["tier"]): [(0, t["held_out_initial"], 5), (8, t["held_out_final"], 5)]
            for t in summary["tiers"]} == {int(k): v for k, v in held_out.items()}
    for name, cost in summary["clients"].items():  # what each client's link carried
        assert cost["bytes_up"] > 0 and cost["bytes_down"] > 0, name
        assert cost["dense_bytes_up"] > 0 and cost["dense_bytes_down"] > 0, name
        assert 0 < cost["compute_s"] < cost["wall_s"], name
        # never faster than the 20 Mbit/s link, up or down (the time also holds latency)
        assert cost["bytes_down"] * 8 / 1e6 / cost["down_s"] <= 20 * 1.05, name
        assert cost["bytes_up"] * 8 / 1e6 / (cost["up_s"] + cost["down_s"]) <= 20 * 1.05
    assert sorted(summary["clients"]) == ["member-0", "member-1"]
    # every replica holds the coordinator's weights for its tier after the last round, and
    # every sequence was trained exactly once
    monkeypatch.setenv("TESTNET_JOIN_TOKEN", "read-the-config")  # the run's own is gone
    check = check_run(RunConfig.load(config), ["member-0", "member-1"])
    timeout_s = RunConfig.load(config).faults.heartbeat_timeout_s
    for name, cost in summary["clients"].items():  # no gap between two heartbeats came
        assert 0 <= cost["heartbeat_gap_s"] < timeout_s, name  # near the timeout
    assert check.replicas == {"member-0": "equal", "member-1": "equal"}, check.replicas
    assert check.audit.exactly_once
    assert "x below dense float32 both ways; computing" in log
    assert "[testnet] killed member-1" in log
    assert "replaced by a new join as 'member-1'" in log  # no wait for the dead one's silence
    assert "[testnet] member-1 rejoined the run" in log
    assert "[testnet] member-1 catches up" in log
    # no round opens without two members ready to train (min_clients = 2, a speed measured),
    # so the restarted client trains again, overlapped or not
    restarted = log[log.index("[testnet] restarting member-1"):]
    assert "[member-1] round" in restarted, restarted
    # one name per process: each line's prefix is the testnet, the server or a member's
    # name, the one the client says it trained under (issue 32, row 9)
    prefixes = {line[1:line.index("]")] for line in log.splitlines()
                if line.startswith("[") and "]" in line}
    assert prefixes == {"testnet", "server", "member-0", "member-1"}, prefixes
    for name in ("member-0", "member-1"):
        assert f"[{name}] matformer-client: {name} trained " in log
    # progress while it runs: a line per round from the server, the finish, the evaluation
    assert re.search(r"\[server\] .* round 7 closed \(8 of 8 rounds done\): ", log), log[-4000:]
    assert "the run is finished: 8 rounds, " in log
    assert "[testnet] evaluating held-out loss of round-8 at tiers 0, 1 on 5 sequences" in log
    # the dashboard lives as long as the command: the server stops after the evaluation
    assert (log.index("[testnet] evaluating held-out loss of round-8") < log.index(
        "stopping; the run is finished")), log[-3000:]


def test_members_at_a_hundredth_of_the_speed_finish_the_run(tmp_path):
    """Issue 45: rounds of 4,096 tokens within 15 s are far beyond three members computing at
    a hundredth of this machine's speed. The rounds ask what they can train in time, so the
    run finishes and no member's finished work is refused. All three start in round 0: the
    speed a round measures is then taken with the machine shared as in the rounds after
    (a third member joining in round 1 once slowed the other two 1.5 times, past the
    deadline's margin, on a busy machine)."""
    build_default_mdat(tmp_path / "d.mdat", limit=60).close()
    model = {**TESTNET_MODEL, "hidden_size": 128, "num_hidden_layers": 4,  # the default run's
             "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512}
    config = local_testnet_toml(tmp_path / "run.toml", deadline=15.0, tokens=4096, rounds=2,
                                min_clients=3, model={"inline": model})
    result = run_testnet(
        [sys.executable, "-m", "matformer.local_testnet.main", "--num-clients", "3",
         "--tiers", "0,1", "--config", str(config), "--client-speeds", "0.01", "--no-eval"],
        cwd=REPO, timeout=240)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-4000:]
    assert re.search(r"round 0 asks [\d,]+ of tokens_per_round 4,096 tokens: its 3 member", log)
    assert "not accepted" not in log and "missed the round" not in log, log[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["rounds"] == 2
    assert "no held-out evaluation (--no-eval)" in log and "evaluating" not in log
    assert re.search(r"the run finished after round 1; the replica holds the weights after "
                     r"\d rounds", log), log[-3000:]
    assert all(t["held_out_final"] is None for t in summary["tiers"])


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlapped"])
def test_chaos_kills_clients_and_the_server_and_loses_nothing(tmp_path, overlap):
    """Synchronous rounds in one process; overlapped ones with the close over 2 shards and
    heartbeats answered by their own process (both die with the killed server, and members
    beat at the restarted one's port), 4-bit values up, 4-bit levels down and late results
    folded in (issue 49: nothing lost or trained twice, replicas equal)."""
    build_default_mdat(tmp_path / "d.mdat", limit=10).close()  # small: the run passes it over
    faults = {"heartbeat_s": 0.5, "heartbeat_timeout_s": 3.0}
    # 30 short rounds: the server's kill (round 18 of this seed's plan) comes well after the
    # clients' and well before the end, however fast rounds run
    low_bits = {"server": {"heartbeat_port": 0}, "compression": {"value_dtype": "int4"},
                "update": {"rule": "sign", "lr": 0.005, "broadcast_bits": 4}}
    config = local_testnet_toml(tmp_path / "run.toml", deadline=20.0, tokens=1024, rounds=30,
                                faults=faults, late_rounds=2 if overlap else 0,
                                **(low_bits if overlap else {}))
    seed = 3
    planned = chaos_plan(seed, rounds=30, clients=["member-0", "member-1"])
    assert [e.target for e in planned].count(SERVER) == 1 and planned[2].round == 18
    result = run_testnet(
        [sys.executable, "-m", "matformer.local_testnet.main", "--num-clients", "2",
         "--tiers", "0,1", "--config", str(config), "--chaos", str(seed),
         *(["--overlap", "--shards", "2"] if overlap else [])],
        cwd=REPO, timeout=300)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    if overlap:
        assert "heartbeats on 127.0.0.1:" in log and "over 2 shards" in log, log[-3000:]
    chaos = json.loads((tmp_path / "run" / "summary.json").read_text())["chaos"]
    assert chaos["passed"] and chaos["rounds"] == 30
    assert chaos["sequences_lost"] == 0 and chaos["sequences_duplicated"] == 0
    assert chaos["passes_complete"] >= 1  # exactly once per pass, over a whole pass
    assert chaos["server_kills"] == 1 and len(chaos["restart_to_round_s"]) == 1
    assert chaos["client_kills"] + chaos["skipped"] == len(planned) - 1
    assert chaos["client_kills"] >= 1
    assert set(chaos["replicas"].values()) == {"equal"}
    assert "[testnet] killed the server (SIGKILL)" in log
    assert "resumed at round" in log  # the coordinator's own account of the restart



def test_the_testnet_hands_the_relay_token_to_the_server_and_its_relays_alone(
        tmp_path, monkeypatch):
    only_join = local_testnet_toml(tmp_path / "run.toml",
                                   auth={"join_token_env": "TESTNET_JOIN_TOKEN"})
    with pytest.raises(testnets.TestnetFailed, match=r"no relay role; add \[auth\] relay_token"):
        token_env(only_join, relays=2)
    assert token_env(only_join, relays=0)[1] == {}
    monkeypatch.delenv("MATFORMER_RELAY_TOKEN", raising=False)
    default = write_default_run(tmp_path / "default", data=tmp_path / "d.mdat", min_clients=1,
                                rounds=1, tokens_per_round=1024)
    env, relay_env = token_env(default, relays=1)
    assert set(relay_env) == {"MATFORMER_RELAY_TOKEN"}  # a token made for this run
    assert relay_env["MATFORMER_RELAY_TOKEN"] != env["MATFORMER_JOIN_TOKEN"]
    plan = testnets.TestnetPlan(config=default, overrides=[], grpc_port=1, http_port=2,
                                run_dir=tmp_path, clients=[], env=env, relay_env=relay_env,
                                relay_ports=[3])
    seen = {}
    for name in ("server", "relay-0", "member-0"):
        child = testnets.Testnet(plan)._child(name, [sys.executable, "-c", (
            "import os; print('token', os.environ.get('MATFORMER_RELAY_TOKEN'))")],
            on_line=lambda line, n=name: seen.setdefault(n, line))
        assert child.wait(60) and child.returncode == 0
    assert seen["server"] == seen["relay-0"] == f"token {relay_env['MATFORMER_RELAY_TOKEN']}"
    assert seen["member-0"] == "token None"


def test_clients_behind_two_relays_train_the_run_and_the_report_shows_the_roots_bytes(
        tmp_path, monkeypatch):
    """Over TLS (each relay trusts the root's certificate and serves its clients with it),
    with overlapped rounds (each relay holds the root's next rounds as the root hands them
    out)."""
    build_default_mdat(tmp_path / "d.mdat", limit=40).close()
    self_signed(tmp_path)
    auth = {"join_token_env": "TESTNET_JOIN_TOKEN", "relay_token_env": "TESTNET_RELAY_TOKEN"}
    config = local_testnet_toml(tmp_path / "run.toml", deadline=20.0, tokens=1024, rounds=6,
                                auth=auth, tls={"cert": "cert.pem", "key": "key.pem"})
    env = {k: v for k, v in os.environ.items() if k not in auth.values()}
    result = run_testnet(
        [sys.executable, "-m", "matformer.local_testnet.main", "--num-clients", "3",
         "--tiers", "0,1", "--config", str(config), "--relays", "2", "--overlap"],
        cwd=REPO, env=env, timeout=240)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["rounds"] == 6 and all(t["improved"] for t in summary["tiers"])
    relays = summary["relays"]
    assert (relays["relays"], relays["members"], relays["rounds"]) == (2, 3, 6), log[-6000:]
    assert relays["root_bytes_in_per_round"] > 0 and relays["root_bytes_out_per_round"] > 0
    assert relays["members_bytes_up_per_round"] > 0
    assert "through 2 relays: the root received " in log
    # the root saw two members, each handing in one partial sum per round
    assert re.search(r"round 5 closed \(6 of 6 rounds done\): [\d,]+ tokens from relay-\d, "
                     r"relay-\d", log)
    assert "relay: round 0: " in log and "partials upstream" in log
    # the clients behind the relays hold the root's weights, and every sequence the run
    # handed out was trained exactly once
    monkeypatch.setenv("TESTNET_JOIN_TOKEN", "read-the-config")
    monkeypatch.setenv("TESTNET_RELAY_TOKEN", "and-its-relays")
    check = check_run(RunConfig.load(config), ["member-0", "member-1", "member-2"])
    assert set(check.replicas.values()) == {"equal"}, check.replicas
    assert check.audit.exactly_once
