"""bench/utilization.py runs end to end at a tiny size: a real coordinator, two members over
simulated links, two timed rounds, synchronous and overlapped, and the JSON it writes holds
every figure of issue 31's "Measure" (what the figures read is the benchmark's to say, not
this test's)."""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
KEYS = {"clients", "compute_s_per_round", "utilization_min", "utilization_median",
        "rounds_per_min", "rpcs_per_round", "heartbeat_p99_ms", "close_ms"}


def test_a_quick_run_writes_every_figure(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # benchmarks import their siblings
    try:
        utilization = importlib.import_module("utilization")
        out = tmp_path / "utilization.json"
        utilization.main(["--quick", "--json", str(out)])
    finally:
        for name in ("utilization", "scale", "harness"):
            sys.modules.pop(name, None)
    cases = json.loads(out.read_text())
    assert [case["overlap"] for case in cases] == [False, True]  # both member loops ran
    for case in cases:
        assert set(case) >= KEYS
        assert case["clients"] == 2 and case["compute_s_per_round"] == 0.2
        assert case["rounds"] == 2  # the timed rounds closed, every member computed in each
        for key in ("utilization_min", "utilization_median"):
            assert 0 < case[key] <= 1
        assert case["utilization_min"] <= case["utilization_median"]
        assert case["rpcs_per_round"] > 0
        assert case["rpcs_by_name"]["SubmitResult"] == 1  # one submission per round, member
        for key in ("rounds_per_min", "heartbeat_p99_ms", "close_ms"):
            assert math.isfinite(case[key]) and case[key] > 0
    # overlapped, the answer to a submission carries the next assignment: no GetRound polls
    assert cases[1]["rpcs_by_name"].get("GetRound", 0) < cases[0]["rpcs_by_name"]["GetRound"]
