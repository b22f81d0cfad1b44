"""Devices, mixed precision, compile and masked-LM training: what real hardware runs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from support.models import tiny_config

from matformer.client.cli import main as client_main
from matformer.client.standalone import main as train_main
from matformer.modeling import AutoregressiveModel, build_model
from matformer.modeling.batching import AdaptiveLimitsConfig, MicrobatchRunner
from matformer.modeling.devices import LossScale, Precision, compile_model, resolve_device
from matformer.modeling.errors import DeviceUnavailable
from matformer.modeling.mdat import build_default_mdat
from matformer.modeling.training import (
    StepOptions,
    TierSchedule,
    tier_gradients,
    train_step_on_examples,
)

ABSENT = "cuda:7" if torch.cuda.device_count() < 8 else "cuda:99"
NO_CPU_COMPILER = shutil.which("g++") is None and shutil.which("c++") is None


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "docs.mdat"
    build_default_mdat(path, limit=150).close()
    return path


def test_an_absent_device_is_a_named_error_not_the_cpu():
    with pytest.raises(DeviceUnavailable, match=f"device '{ABSENT}'"):
        resolve_device(ABSENT)
    with pytest.raises(DeviceUnavailable, match="not a device name"):
        resolve_device("gpu0")
    if not torch.backends.mps.is_available():
        with pytest.raises(DeviceUnavailable, match="MPS backend is not available"):
            resolve_device("mps")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("command", ["matformer-train", "matformer-client train"])
def test_training_on_an_absent_device_exits_with_the_named_error(command, tmp_path, capsys):
    args = ["--device", ABSENT, "--data", str(tmp_path / "none.mdat"), "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        if command == "matformer-train":
            train_main(args)
        else:
            client_main(["train", *args])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith(f"{command.split()[0]}: error: device '{ABSENT}'")
    assert "\n" not in error
    assert not (tmp_path / "model.safetensors").exists()


def batch(count=6, seed=0):
    draw = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (int(n),), generator=draw)
            for n in torch.randint(8, 40, (count,), generator=draw)]


def assert_trains_in(precision: Precision) -> None:
    """12 steps on ``precision.device`` at tiers 0 and 1: a finite loss that falls by more
    than 1, and float32 weights and gradients (autocast computes in bf16/fp16, never stores)."""
    model = AutoregressiveModel(tiny_config()).to(precision.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    runner = MicrobatchRunner(model, AdaptiveLimitsConfig(max_tokens=64).build())
    options = StepOptions(precision=precision)
    examples = [example.to(precision.device) for example in batch()]
    losses = []
    for step in range(12):
        optimizer.zero_grad()
        losses.append(train_step_on_examples(runner, optimizer, examples,
                                             TierSchedule(tiers=[0, 1]), step,
                                             options=options)["0"])
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 1.0
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in model.parameters())


def test_bf16_autocast_trains_with_finite_falling_loss_and_float32_weights():
    assert_trains_in(Precision("bf16"))


def test_fp16_overflow_is_recomputed_at_a_smaller_scale_not_skipped():
    examples = batch(seed=1)

    def gradient(precision):
        torch.manual_seed(0)
        model = AutoregressiveModel(tiny_config())
        runner = MicrobatchRunner(model, AdaptiveLimitsConfig(max_tokens=64).build())
        tier_gradients(runner, examples, TierSchedule(), 0,
                       options=StepOptions(precision=precision))
        return {n: p.grad for n, p in model.named_parameters()}

    scale = LossScale(scale=2.0 ** 32)  # far past fp16's range: the first passes overflow
    fp16 = gradient(Precision("fp16", loss_scale=scale))
    assert scale.scale < 2.0 ** 32 and scale.clean_steps == 1
    fp32 = gradient(Precision("fp32"))
    for name, grad in fp32.items():
        assert torch.isfinite(fp16[name]).all()
        torch.testing.assert_close(fp16[name], grad, atol=2e-3, rtol=5e-2, msg=name)


def assert_compiled_gives_eager_logits(device: torch.device | str = "cpu") -> None:
    """``compile_model`` (--compile) changes no logit of a tiny model on ``device``."""
    torch.manual_seed(0)
    model = build_model(tiny_config()).eval().to(device)
    ids = torch.randint(3, 90, (2, 24)).to(device)
    with torch.no_grad():
        eager = model(ids, tier=1)
        compiled = compile_model(model)(ids, tier=1)
    torch.testing.assert_close(compiled, eager, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(NO_CPU_COMPILER, reason="torch.compile on CPU needs a C++ compiler")
def test_the_compiled_model_gives_the_eager_logits():
    assert_compiled_gives_eager_logits()


def test_a_masked_model_trains_standalone(docs, tmp_path, capsys):
    config = tmp_path / "bert.json"
    config.write_text(json.dumps({
        "vocab_size": 260, "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256,
        "max_position_embeddings": 128, "is_causal": False, "mask_token_id": 259}))
    out = tmp_path / "run"
    train_main(["--config", str(config), "--data", str(docs), "--seq-len", "128",
                "--batch-tokens", "512", "--steps", "30", "--warmup-steps", "3",
                "--tiers", "0,1", "--out", str(out)])
    metrics = json.loads((out / "metrics.json").read_text())
    for tier in ("0", "1"):
        assert metrics["final"][tier] < metrics["initial"][tier] - 1.0
    assert (metrics["world_size"], metrics["device"], metrics["precision"]) == (1, "cpu", "fp32")
    saved = json.loads((out / "config.json").read_text())
    assert saved["is_causal"] is False


@pytest.mark.cuda
def test_bf16_training_on_cuda_keeps_float32_weights_and_falls(docs, tmp_path):
    out = tmp_path / "run"
    train_main(["--device", "cuda", "--precision", "bf16", "--data", str(docs),
                "--seq-len", "128", "--batch-tokens", "512", "--steps", "30",
                "--warmup-steps", "3", "--tiers", "0,1", "--track", "none", "--out", str(out)])
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["device"] == "cuda:0" and metrics["precision"] == "bf16"
    for tier in ("0", "1"):
        assert metrics["final"][tier] < metrics["initial"][tier] - 1.0
