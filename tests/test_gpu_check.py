"""bench/gpu_check.py keeps what it measured: each step's result is on disk as soon as the
step ends, a step past its cap is killed with every process it started, and what the run's
time limit leaves no room for is said, not silently dropped. (Its plan, the commands a GPU
runs, is checked by its smoke pass in tests/test_bench_smoke.py.)"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    module = importlib.import_module("gpu_check")
    yield module
    sys.modules.pop("gpu_check", None)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a killed one not yet reaped is a zombie: "Z")."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_a_step_past_its_cap_is_killed_with_its_children_and_the_rest_is_kept(
        gpu_check, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 0.0)
    figures = tmp_path / "figures.json"
    child_pid = tmp_path / "child.pid"
    seen_after_first: list[dict] = []

    def read(step, printed):
        return {"figures": json.loads(step.outputs["json"].read_text()), "headline": "4 tok/s",
                "printed": printed.strip()}

    def look(step, budget):  # runs after the first two: what is on disk by then
        seen_after_first.append(json.loads((tmp_path / "out" / "gpu_check.json").read_text()))
        return {"status": "passed"}

    # the second step starts a grandchild that would outlive a plain kill of its parent
    hang = ("import subprocess, sys, time, pathlib; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"pathlib.Path({str(child_pid)!r}).write_text(str(p.pid)); time.sleep(60)")
    steps = [
        gpu_check.Step("measure", "writes figures", cap_s=60,
                       command=python(f"import json; json.dump({{'tps': 4}}, "
                                      f"open({str(figures)!r}, 'w')); print('measured')"),
                       outputs={"json": figures}, read=read),
        gpu_check.Step("hang", "never ends", cap_s=3, command=python(hang)),
        gpu_check.Step("look", "reads the file", cap_s=60, action=look),
        gpu_check.Step("gpu", "needs a GPU", cap_s=60, skip="no GPU here"),
    ]
    args = argparse.Namespace(out=tmp_path / "out", time_limit=120.0)
    machine = gpu_check.Machine("3.11", "2.13.0+cpu", None, 0, [], [])
    code = gpu_check.Check(args, machine, tmp_path).run(steps)

    assert code == 1  # a step timed out
    first = seen_after_first[0]["steps"]
    assert first["measure"]["status"] == "passed"
    assert first["measure"]["figures"] == {"tps": 4}
    assert first["measure"]["printed"] == "measured"
    assert first["hang"]["status"] == "timed out"
    assert not running(int(child_pid.read_text()))  # the grandchild went with it
    final = json.loads((tmp_path / "out" / "gpu_check.json").read_text())["steps"]
    assert [final[s]["status"] for s in ("measure", "hang", "look", "gpu")] == [
        "passed", "timed out", "passed", "skipped"]
    assert final["gpu"]["reason"] == "no GPU here"
    assert "measured" in final["measure"]["log_tail"]
    assert "| measure | passed |" in (tmp_path / "out" / "gpu_check.md").read_text()
    assert "===== hang:" in (tmp_path / "out" / "gpu_check.log").read_text()


def test_steps_the_time_limit_leaves_no_room_for_are_reported_not_run(gpu_check, tmp_path):
    steps = [gpu_check.Step("late", "anything", cap_s=60, command=python("print(1)"))]
    args = argparse.Namespace(out=tmp_path, time_limit=gpu_check.MIN_STEP_S - 1)
    machine = gpu_check.Machine("3.11", "2.13.0+cpu", None, 0, [], [])
    assert gpu_check.Check(args, machine, tmp_path).run(steps) == 1
    late = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]["late"]
    assert late["status"] == "not run"
    assert "--time-limit" in late["reason"]


def test_the_readers_read_what_the_steps_write(gpu_check, tmp_path, monkeypatch):
    """Each step's reader on the real files its program writes (tiny runs on the CPU), so
    that the one run on a GPU does not lose a headline to a renamed key."""
    figures = {}
    for script, argv in (("tier_throughput", ["--tiers", "0,1"]), ("train_step_vs_hf", []),
                         ("device_round", [])):
        figures[script] = tmp_path / f"{script}.json"
        monkeypatch.setattr(sys, "argv", [script, "--smoke", "--json", str(figures[script]),
                                          *argv])
        importlib.import_module(script).main()
    step = gpu_check.Step("s", "", cap_s=1, outputs={"json": figures["tier_throughput"]})
    assert gpu_check.read_tiers(step, "")["headline"].startswith("t0 ")
    step.outputs["json"] = figures["train_step_vs_hf"]
    assert "ours/hf" in gpu_check.read_hf(step, "")["headline"]
    step.outputs["json"] = figures["device_round"]
    read = gpu_check.read_round(step, "")
    assert "status" not in read and read["headline"].count("hash equal") == 2

    from matformer.local_testnet.report import TierReport, write_summary
    summary = write_summary(tmp_path / "summary.json", [TierReport(
        tier=0, clients=1, first_round_loss=5.0, last_round_loss=3.0, held_out_initial=5.1,
        held_out_final=2.9)],
                            {"round": 30}, wall_s=12.5)
    step.outputs["summary"] = summary
    read = gpu_check.read_testnet(step, "[member-0] round 3 ...\n")
    assert read["headline"] == ("30 rounds in 12.5 s; held-out tier 0 5.100 → 2.900; replica "
                                "hash mismatches: 0")
    diverged = "weight hash after round 4 differs from the coordinator's; reloading"
    assert gpu_check.read_testnet(step, diverged)["status"] == "failed"

    tests = tmp_path / "test_three.py"
    tests.write_text("import pytest\n"
                     "def test_passes(): pass\n"
                     "def test_fails(): assert 1 == 2\n"
                     "@pytest.mark.skip(reason='no GPU')\n"
                     "def test_skips(): pass\n")
    step.outputs["junit"] = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                    f"--junitxml={step.outputs['junit']}", str(tests)], cwd=tmp_path,
                   capture_output=True)
    read = gpu_check.read_junit(step, "")
    assert read["tests"] == {"passed": 1, "failed": 1, "skipped": 1}
    assert read["skips"][0]["reason"] == "no GPU"
    assert read["failures"][0]["test"].endswith("::test_fails")


def test_only_reruns_the_steps_named_and_says_why_the_rest_do_not_run(gpu_check, tmp_path):
    """What a run's time limit left is run again alone (--only), after install and
    environment; on one GPU the NCCL step still says it needs two."""
    args = gpu_check.parse_args(["--only", "testnet,nccl"])
    machine = gpu_check.Machine("3.12", "2.11.0+cu130", "13.0", 1, ["NVIDIA H200"], [139.8])
    steps = {s.name: s for s in gpu_check.plan(args, machine, tmp_path)}
    assert list(steps) == ["install", "environment", *gpu_check.STEPS]
    assert steps["install"].skip is None and steps["testnet"].skip is None
    assert steps["train_1b_hf"].skip == "not in --only"
    assert steps["nccl"].skip == "this machine has 1 GPU; NCCL data parallel needs 2"
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--only", "tesnet"])
