"""Data parallelism on CPU with Gloo: 2 processes spawned by torchrun give 1 process's step."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dp_gradient import step

from matformer.modeling.batching.accumulate import TrainingExamples
from matformer.modeling.distributed import DataParallel
from matformer.modeling.mdat import build_default_mdat

TESTS = Path(__file__).parent


def torchrun(ranks: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``torchrun --standalone`` (a free port of its own) with ``ranks`` CPU processes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={ranks}", *args],
        cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.parametrize("objective", ["causal", "masked"])
def test_two_ranks_sum_to_the_single_process_gradient(objective, tmp_path):
    torchrun(2, str(TESTS / "dp_gradient.py"), str(tmp_path / "dp.pt"), objective)
    parallel = torch.load(tmp_path / "dp.pt")
    single = step(objective, None)
    assert parallel["losses"] == pytest.approx(single["losses"], rel=1e-6)
    for name, grad in single["grads"].items():
        torch.testing.assert_close(parallel["grads"][name], grad, atol=1e-7, rtol=1e-5,
                                   msg=name)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL data parallelism needs 2 GPUs")
def test_two_nccl_ranks_sum_to_the_single_gpu_gradient(tmp_path):
    torchrun(2, str(TESTS / "dp_gradient.py"), str(tmp_path / "dp.pt"), "causal", "cuda")
    parallel = torch.load(tmp_path / "dp.pt")
    single = step("causal", None, torch.device("cuda"))
    assert parallel["losses"] == pytest.approx(single["losses"], rel=1e-5)
    for name, grad in single["grads"].items():
        torch.testing.assert_close(parallel["grads"][name], grad, atol=1e-6, rtol=1e-4,
                                   msg=name)


def test_shares_split_rows_by_tokens_and_cover_the_batch():
    sizes = [30, 2, 17, 9, 4, 11, 23]
    shares = [DataParallel(rank=r, world_size=3, device=torch.device("cpu")).share(sizes)
              for r in range(3)]
    assert sorted(i for share in shares for i in share) == list(range(len(sizes)))
    loads = [sum(sizes[i] for i in share) for share in shares]
    assert max(loads) - min(loads) <= max(sizes)
    assert DataParallel(rank=3, world_size=4, device=torch.device("cpu")).share([5, 5]) == []


def test_masks_depend_on_the_documents_position_not_on_the_share():
    from support.models import tiny_config

    from matformer.modeling import BERTModel

    model = BERTModel(tiny_config(is_causal=False))
    docs = [torch.randint(3, 90, (40,)) for _ in range(4)]
    whole = TrainingExamples.of(model, docs, seed=3)
    part = TrainingExamples.of(model, docs[2:], seed=3, positions=[2, 3])
    for a, b in zip(whole.inputs[2:], part.inputs, strict=True):
        assert torch.equal(a, b)
    assert all(bool((label != -100).any()) for label in whole.labels)


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "docs.mdat"
    build_default_mdat(path, limit=120).close()
    return path


@pytest.mark.parametrize("mode", ["replicated", "fsdp"])
def test_standalone_training_on_two_ranks_follows_the_one_rank_run(mode, docs, tmp_path):
    """Replicated: every rank holds the model, gradients summed after the step's passes.
    FSDP2: every rank holds a shard, gathered and reduced in lockstep passes."""
    args = ["-m", "matformer.client.standalone", "--data", str(docs), "--steps", "6",
            "--warmup-steps", "2", "--batch-tokens", "512", "--seq-len", "128",
            "--tiers", "0,2", "--log-every", "3"]
    torchrun(2, *args, *(["--fsdp"] if mode == "fsdp" else []), "--out", str(tmp_path / "two"))
    torchrun(1, *args, "--out", str(tmp_path / "one"))
    two = json.loads((tmp_path / "two" / "metrics.json").read_text())
    one = json.loads((tmp_path / "one" / "metrics.json").read_text())
    assert (two["world_size"], one["world_size"]) == (2, 1)
    assert two["fsdp"] is (mode == "fsdp")
    assert (two["device"], two["precision"], two["batching"]) == ("cpu", "fp32", "packed")
    for a, b in zip(two["history"], one["history"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert two["final"] == pytest.approx(one["final"], rel=1e-5)


def test_fsdp_needs_torchrun(docs, tmp_path, capsys):
    from matformer.client.standalone import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(docs), "--fsdp", "--out", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "--fsdp shards the model over the ranks torchrun starts" in capsys.readouterr().err


def test_an_fsdp_run_resumes_bit_for_bit_and_on_any_number_of_ranks(docs, tmp_path):
    from safetensors.torch import load_file

    args = ["-m", "matformer.client.standalone", "--data", str(docs), "--steps", "6",
            "--warmup-steps", "2", "--batch-tokens", "512", "--seq-len", "128", "--tiers", "0,2",
            "--save-every", "2", "--keep-last", "3", "--track", "none"]
    straight = tmp_path / "straight"
    torchrun(2, *args, "--fsdp", "--out", str(straight))
    saved = tmp_path / "straight" / "checkpoints"
    assert sorted(p.name for p in saved.iterdir()) == ["step-2", "step-4", "step-6"]
    # the checkpoint holds whole tensors: the optimizer's moments have the weights' shapes
    state = load_file(saved / "step-2" / "training_state.safetensors")
    weights = load_file(saved / "step-2" / "model.safetensors")
    embedding = weights["model.embed_tokens.weight"].shape
    assert embedding in {v.shape for k, v in state.items() if k.endswith("exp_avg")}

    def copied(step, run):  # a checkpoint resumes into its own run: each gets a copy
        shutil.copytree(saved / step, tmp_path / run / "checkpoints" / step)
        return str(tmp_path / run / "checkpoints" / step)

    torchrun(2, *args, "--fsdp", "--resume", copied("step-2", "resumed"))
    torchrun(1, *args, "--resume", copied("step-4", "one"))
    final = load_file(straight / "model.safetensors")
    resumed = load_file(tmp_path / "resumed" / "model.safetensors")
    assert all(torch.equal(final[k], resumed[k]) for k in final)
    metrics = [json.loads((tmp_path / run / "metrics.json").read_text())
               for run in ("straight", "resumed", "one")]
    assert metrics[0]["history"] == metrics[1]["history"]
    assert metrics[0]["final"] == metrics[1]["final"]
    assert metrics[2]["world_size"] == 1 and not metrics[2]["fsdp"]
    for a, b in zip(metrics[0]["history"], metrics[2]["history"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
