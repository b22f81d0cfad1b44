"""Every benchmark under bench/ runs end to end: ``python bench/X.py --smoke`` (the same code
path at tiny sizes, seconds long; ``harness.parse``) in a process of its own, from an empty
folder, as a user would run it, so that none rots unseen (bench/federated_quality.py and
bench/tier_quality.py once failed at import on main, and nothing noticed). Benchmarks are
found by glob: a new one without ``--smoke``, or without its line in EXPECTED, fails here.
What the figures read is each benchmark's to say (a smoke pass's say nothing); this checks
that it ran, printed its table or ratios and, where it has ``--json``, wrote the keys its
docstring names. No time is asserted.

The passes start together when the module's first test runs, as many at a time as this
process may use cores (each is mostly one busy thread), and each test waits for its own: the
module costs about its CPU time over the cores, not its sum."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "harness")
TIMEOUT_S = 300  # generous: CI shares two cores; a pass takes seconds


@dataclass(frozen=True)
class Expected:
    printed: str  # a fragment of the table or ratios the benchmark prints at its end
    # What --json writes, as dotted paths ("models.ours.ms_per_step"); a list at any step
    # (the file itself, or a value) must hold the rest of the path in each of its items.
    keys: frozenset[str] = field(default_factory=frozenset)


def expect(printed: str, *keys: str) -> Expected:
    return Expected(printed, frozenset(keys))


def per(names: tuple[str, ...], *keys: str) -> tuple[str, ...]:
    return tuple(f"{name}.{key}" for name in names for key in keys)


GPU_STEPS = ("cuda_tests", "train_125m_tiers", "train_125m_hf", "close_apply", "testnet",
             "train_1b_tiers", "train_1b_hf", "nccl")
EXPECTED = {
    "attention_long": expect("speedup = sdpa time / wersa time", "settings", "torch",
                             *(f"lengths.{key}" for key in ("seq_len", "sdpa_s", "wersa_s",
                                                           "speedup", "sdpa_peak_mib",
                                                           "wersa_peak_mib"))),
    "checkpoint_io": expect("ours/transformers"),
    "compression": expect("aggregate dct, one result per tier"),
    "data_parallel": expect("vs 1 rank", "tokens_per_s_ratio",
                            *per(("runs.2fsdp",), "tokens_per_s", "final_loss",
                                 "peak_rss_bytes_per_rank")),
    "device_round": expect("replica hash", "cpu_close_s", "cpu_apply_s", "device_close_s",
                           "device_apply_s", "close_hash", "apply_hash", "cpu_apply_hash",
                           "close_bits_vs_cpu"),
    "netns_faults": expect("recovery / heartbeat timeout", "cut_s", "heartbeat_timeout_s",
                           "coordinator_noticed_s", "member_noticed_s", "recovered_s",
                           "recovery_over_timeout", "sequences_lost", "replicas_equal"),
    "federated_quality": expect("final loss LB / P",
                                *per(("A", "LB", "D", "P"), "final", "bytes_up", "bytes_down"),
                                "D.data_parallel"),
    "gpu_check": expect("pytest -m cuda selects", "machine", "cuda_tests", *per(
        ("steps",), *(f"{step}.runs" for step in GPU_STEPS))),
    "local_round_memory": expect("local steps add",
                                 *per(("gradient", "local"), "model_mib", "peak_mib",
                                      "round_mib", "seconds_per_round")),
    "many_members": expect("coord cpu s/round", "members", "rounds_per_min", "close_ms",
                           "coordinator_cpu_s_per_round", "coordinator_rss_mib",
                           "bytes_in_per_round", "bytes_out_per_round", "heartbeat_p99_ms"),
    "mdat_pretokenize": expect("bpe-4096, fixed_chunks"),
    "mdat_read": expect("vs memmap"),
    # its smoke pass gives one model (unordered) the federated finetune: each takes ~30 s
    "neuron_order": expect("activations/unordered", "settings", *per(("before", "after"), *(
        f"{run}.tier{t}" for run in ("unordered", "weights", "activations") for t in (0, 1, 2))),
        *per(("federated.unordered",), "tier0", "tier1", "tier2")),
    "scale": expect("x 1 shard", "clients", "close_ms", "score_ms", "bytes_up",
                    "bytes_down", "dense_bytes_up", "dense_bytes_down", "update_apply_s",
                    "apply_s", "one_pass_ms", "close_passes", "apply_passes",
                    "heartbeat_p99_ms", "shards", "shard_rss_mib", "shard_peak_rss_mib"),
    "status_api": expect("page poll / metrics"),
    "tier_quality": expect("targets: joint tier 0 < 1 < 2", "joint", "tier0_sliced",
                           "independent", "initial", "tokens", "seconds", "config", "slice"),
    "tier_throughput": expect("speed vs t0", "settings", "device_peak_bytes",
                              *per(("tiers.0", "tiers.1", "tiers.2"), "ffn_width",
                                   "tokens_per_s", "step_peak_bytes", "mfu")),
    "slow_readers": expect("status p99 with readers / without", "readers", "blob_bytes",
                           "status_p99_ratio", "rss_mib_before",
                           *per(("reference",), "status_p50_ms", "status_p99_ms"),
                           *per(("passes",), "streams_open", "status_p99_ms",
                                "rss_mib_during", "rss_mib_after")),
    "token_budget": expect("throughput packed/padded", "planning_waste", "training",
                           "throughput_packed_over_padded", "throughput_packed_over_fixed",
                           "throughput_padded_over_fixed"),
    "train_step_vs_hf": expect("throughput ours/hf", "settings", "first_loss",
                               "throughput_ours_over_hf", "step_peak_ours_over_hf",
                               *per(("models.ours", "models.hf"), "ms_per_step",
                                    "tokens_per_s", "step_peak_bytes")),
    "utilization": expect("utilization min", "clients", "compute_s_per_round",
                          "utilization_min", "utilization_median", "rounds_per_min",
                          "rpcs_per_round", "heartbeat_p99_ms", "close_ms"),
}


def utilization_figures(cases: list[dict[str, Any]]) -> None:
    """What bench/utilization.py's figures must hold whatever they read: both member loops
    ran their timed rounds, every member computed in each, and overlapped members never
    poll GetRound (the answer to a submission carries the next assignment)."""
    assert [case["overlap"] for case in cases] == [False, True]
    for case in cases:
        assert case["clients"] == 2 and case["rounds"] == 2
        assert 0 < case["utilization_min"] <= case["utilization_median"] <= 1
        assert case["rpcs_by_name"]["SubmitResult"] == 1  # one submission per round, member
        for key in ("rounds_per_min", "heartbeat_p99_ms", "close_ms"):
            assert math.isfinite(case[key]) and case[key] > 0
    assert cases[1]["rpcs_by_name"].get("GetRound", 0) < cases[0]["rpcs_by_name"]["GetRound"]


def device_round_figures(figures: dict[str, Any]) -> None:
    """The close and the apply on the second device (the CPU again, in a smoke pass) leave
    the CPU's bits."""
    assert (figures["close_hash"], figures["apply_hash"], figures["cpu_apply_hash"],
            figures["close_bits_vs_cpu"]) == ("equal", "equal", "equal", "equal")


def gpu_check_plan(plan: dict[str, Any]) -> None:
    """The check plans every step the GPU must prove, in the order it runs them, and
    ``-m cuda`` selects the GPU twins of the CPU's equivalence tests."""
    assert list(plan["steps"]) == ["install", "environment", *GPU_STEPS]
    assert not any(step["missing"] for step in plan["steps"].values())
    assert any("test_cuda.py::" in test for test in plan["cuda_tests"])


CHECKS = {"utilization": utilization_figures, "device_round": device_round_figures,
          "gpu_check": gpu_check_plan}  # a benchmark's figures checked beyond keys


def missing(data: Any, path: str) -> bool:
    """Whether ``data`` lacks the dotted ``path`` (in any item of a list on the way)."""
    if isinstance(data, list):
        return not data or any(missing(item, path) for item in data)
    if not path:
        return False
    key, _, rest = path.partition(".")
    return not isinstance(data, dict) or key not in data or missing(data[key], rest)


def has_json(script: str) -> bool:
    return '"--json"' in (BENCH / f"{script}.py").read_text()


@dataclass(frozen=True)
class Pass:
    done: subprocess.CompletedProcess[str]
    figures: Path  # where --json wrote, if the benchmark has it


def smoke(script: str, folder: Path) -> Pass:
    """``bench/<script>.py --smoke`` (with ``--json folder/figures.json`` where it has one),
    run in ``folder``, empty, so that what it writes under runs/ stays there."""
    figures = folder / "figures.json"
    out = ["--json", str(figures)] if has_json(script) else []
    done = subprocess.run([sys.executable, str(BENCH / f"{script}.py"), "--smoke", *out],
                          cwd=folder, capture_output=True, text=True, timeout=TIMEOUT_S)
    return Pass(done, figures)


@pytest.fixture(scope="module")
def passes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[dict[str, Future[Pass]]]:
    """The smoke pass of every benchmark this session selected, started at once."""
    selected = [item.callspec.params["script"] for item in request.session.items
                if item.module is request.module and hasattr(item, "callspec")]
    with ThreadPoolExecutor(len(os.sched_getaffinity(0))) as pool:
        yield {script: pool.submit(smoke, script, tmp_path_factory.mktemp(script))
               for script in selected}


@pytest.mark.parametrize("script", SCRIPTS)
def test_the_benchmark_runs_its_smoke_pass(script, passes):
    assert script in EXPECTED, (
        f"bench/{script}.py has no line in EXPECTED: give it a --smoke pass "
        "(harness.parse) and name what it prints and what its --json holds")
    expected = EXPECTED[script]
    assert has_json(script) == bool(expected.keys), (
        f"bench/{script}.py {'has' if has_json(script) else 'has no'} --json: "
        f"{'list' if has_json(script) else 'drop'} its keys in EXPECTED")
    ran = passes[script].result()
    done = ran.done
    report = f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
    assert done.returncode == 0, report
    assert expected.printed in done.stdout, report
    if expected.keys:
        figures = json.loads(ran.figures.read_text())
        lacking = sorted(path for path in expected.keys if missing(figures, path))
        assert not lacking, f"bench/{script}.py --json lacks {lacking}"
        CHECKS.get(script, lambda _: None)(figures)
