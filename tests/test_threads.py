"""CPU threads (issue 45): asked for, else $OMP_NUM_THREADS, else the cores idle now; threads
that wait sleep instead of spinning; every command that computes takes --threads and the
standalone run records what it used."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from matformer.modeling import threads
from matformer.modeling.errors import InvalidValue
from matformer.modeling.threads import choose_threads, idle_cores


@pytest.fixture
def no_omp(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 4)


def test_idle_cores_are_the_idle_share_of_the_cpu_time_counters(monkeypatch):
    samples = iter([(1000, 4000), (1600, 4800)])  # busy 600 of 800 jiffies: 3/4 busy
    monkeypatch.setattr(threads, "_cpu_times", lambda: next(samples))
    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert idle_cores(0.0) == pytest.approx(2.0)


@pytest.mark.parametrize(("idle", "processes", "count"), [
    (0.3, 1, 1),  # a fully busy machine still gets one thread
    (1.6, 1, 2),
    (3.9, 1, 4),
    (3.9, 2, 2),  # two torchrun ranks share what is idle
])
def test_unasked_the_count_is_the_idle_cores_at_least_one(idle, processes, count, no_omp,
                                                           monkeypatch):
    monkeypatch.setattr(threads, "idle_cores", lambda sample_s: idle)
    chosen = choose_threads(processes=processes)
    assert (chosen.count, chosen.idle) == (count, idle)
    assert f"{idle:.1f} of 4 cores idle" in chosen.describe()


def test_asked_for_and_omp_num_threads_win_over_the_measurement(no_omp, monkeypatch):
    monkeypatch.setattr(threads, "idle_cores", lambda sample_s: pytest.fail("measured"))
    assert choose_threads(3).describe() == "3 threads (asked for)"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert choose_threads().describe() == "1 thread (OMP_NUM_THREADS)"
    assert choose_threads(2).count == 2
    with pytest.raises(InvalidValue, match="--threads must be at least 1, got 0"):
        choose_threads(0)


@pytest.mark.parametrize("given", [None, "ACTIVE"])
def test_the_package_makes_waiting_threads_sleep_unless_told_otherwise(given):
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given:
        env["OMP_WAIT_POLICY"] = given
    done = subprocess.run([sys.executable, "-c", "import matformer, os; "
                           "print(os.environ['OMP_WAIT_POLICY'])"],
                          env=env, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == (given or "PASSIVE")
