"""Reading a run's sequences: ``--num-workers`` threads read the next steps ahead and the run
is the one read in the loop, bit for bit; under torchrun each rank reads only its share of
each step, and two ranks still train what one process trains."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.helpers import train_data

from matformer.client import seed_config, standalone
from matformer.client.step_batches import PREFETCH_FACTOR
from matformer.modeling.mdat.sequences import SequenceReader

TESTS = Path(__file__).parent
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return train_data(tmp_path_factory.mktemp("workers"))


def argv(data: Path, out: Path, *extra: str) -> list[str]:
    return ["--data", str(data / "docs.mdat"), "--config", str(data / "model.json"),
            "--seq-len", "128", "--batch-tokens", "512", "--tiers", "0,2", "--warmup-steps", "2",
            "--track", "none", "--out", str(out), *extra]


def test_workers_read_ahead_on_their_threads_and_train_the_same_run(data, tmp_path,
                                                                    monkeypatch):
    read, steps = [], []  # (thread, ids) per read; per step: its tokens, reads done before it
    given, step = standalone.sequences, standalone.train_step_on_examples

    def recorded(reader, ids, device):
        read.append((threading.current_thread().name, ids.tolist()))
        return given(reader, ids, device)

    def stepping(runner, optimizer, examples, *args, **kwargs):
        steps.append(([e.tolist() for e in examples], len(read)))
        return step(runner, optimizer, examples, *args, **kwargs)

    monkeypatch.setattr(standalone, "sequences", recorded)
    monkeypatch.setattr(standalone, "train_step_on_examples", stepping)
    runs = {}
    for workers in (0, 2):
        read.clear(), steps.clear()
        out = tmp_path / f"w{workers}"
        standalone.main(argv(data, out, "--steps", "8", "--num-workers", str(workers)))
        runs[workers] = {"read": list(read), "steps": list(steps),
                         "weights": load_file(out / "model.safetensors"),
                         "metrics": json.loads((out / "metrics.json").read_text())}
    plain, ahead = runs[0], runs[2]
    assert [tokens for tokens, _ in ahead["steps"]] == [tokens for tokens, _ in plain["steps"]]
    assert ahead["metrics"]["history"] == plain["metrics"]["history"]
    assert ahead["metrics"]["final"] == plain["metrics"]["final"]
    assert all(torch.equal(ahead["weights"][k], w) for k, w in plain["weights"].items())
    # the held-out sequences are read first, in the loop; then each step's: by the workers
    assert all(thread == "MainThread" for thread, _ in plain["read"])
    assert ahead["read"][0] == plain["read"][0]
    assert all(thread.startswith("matformer-data") for thread, _ in ahead["read"][1:])
    assert sorted(ids for _, ids in ahead["read"][1:]) == \
        sorted(ids for _, ids in plain["read"][1:])
    # step k starts with no more read than the held-out ones and steps 0 .. k + 2 x 2 workers
    assert all(done <= 1 + (k + 1) + 2 * PREFETCH_FACTOR
               for k, (_, done) in enumerate(ahead["steps"]))


def test_the_seeds_num_workers_is_the_runs():
    seed = seed_config.read(TESTS / "fixtures" / "seed000_config.json", [], None)
    assert seed.options["num_workers"] == ("data.num_workers", 1)


def torchrun(ranks: int, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={ranks}", *args],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_each_rank_reads_its_share_and_two_ranks_train_the_one_process_run(data, tmp_path,
                                                                           monkeypatch):
    """Two Gloo ranks (with a data worker each): together they read what one process reads,
    the held-out sequences once (rank 0) and every step's sequences once, each its share;
    their run is the one process's run."""
    common = ["--steps", "4", "--num-workers", "1"]
    torchrun(2, str(TESTS / "train_reads.py"), str(tmp_path / "reads"),
             *argv(data, tmp_path / "two", *common))
    ranks = [json.loads((tmp_path / f"reads.{rank}").read_text()) for rank in (0, 1)]

    read, given = [], SequenceReader.__getitem__
    monkeypatch.setattr(SequenceReader, "__getitem__",
                        lambda reader, index: read.append(int(index)) or given(reader, index))
    standalone.main(argv(data, tmp_path / "one", *common))

    assert ranks[0] and ranks[1] and not set(ranks[0]) & set(ranks[1])
    assert sorted(ranks[0] + ranks[1]) == sorted(read)  # each sequence once, all of them
    two, one = (json.loads((tmp_path / run / "metrics.json").read_text())
                for run in ("two", "one"))
    assert (two["world_size"], one["world_size"]) == (2, 1)
    for a, b in zip(two["history"], one["history"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert two["final"] == pytest.approx(one["final"], rel=1e-5)
    final = [load_file(tmp_path / run / "model.safetensors") for run in ("two", "one")]
    for name, weight in final[1].items():
        torch.testing.assert_close(final[0][name], weight, atol=1e-6, rtol=1e-5, msg=name)
