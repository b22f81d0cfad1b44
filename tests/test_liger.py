"""The ``liger`` entries: torch runs wherever Liger cannot, and where it can they agree."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch
from support.models import tiny_config

from matformer.modeling import AutoregressiveModel, registry
from matformer.modeling.components import liger
from matformer.modeling.components.liger import LigerCrossEntropy, LigerRMSNorm, LigerSwiGLU
from matformer.modeling.components.loss import IGNORE_INDEX, CrossEntropy
from matformer.modeling.components.mlp import SwiGLU
from matformer.modeling.components.norms import RMSNorm
from matformer.modeling.registry import Implementation

ENTRIES = {  # (category, variant) → (torch class, liger class)
    ("norm", "rmsnorm"): (RMSNorm, LigerRMSNorm),
    ("mlp", "swiglu"): (SwiGLU, LigerSwiGLU),
    ("loss", "cross_entropy"): (CrossEntropy, LigerCrossEntropy),
}
LIGER_INSTALLED = importlib.util.find_spec("liger_kernel") is not None


@pytest.fixture(autouse=True)
def _fresh_reports(monkeypatch):
    """Every test sees the one-line reports anew."""
    monkeypatch.setattr(registry, "_reported", set())
    monkeypatch.setattr(liger, "_reported", set())


def ask_for_liger(monkeypatch, how: str, entries=ENTRIES) -> None:
    for category, variant in entries:
        if how == "environment":
            monkeypatch.setenv(f"MATFORMER_{category}_{variant}".upper(), "liger")
        else:
            registry.set_preferences({category: {variant: "liger"}})


def built(model: AutoregressiveModel, category: str) -> torch.nn.Module:
    """The module a model built for ``category`` (in its first layer, or its loss)."""
    layer = model.model.layers[0]
    return {"norm": layer.input_layernorm, "mlp": layer.mlp, "loss": model.loss_fn}[category]


def matformer_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("matformer")]


def test_liger_entries_rank_below_torch_and_need_liger_and_cuda():
    for (category, variant), (torch_cls, liger_cls) in ENTRIES.items():
        impls = {impl.name: impl for impl in registry.implementations(category, variant)}
        assert impls["liger"].priority < impls["torch"].priority
        assert impls["liger"].requires == ("liger_kernel",)
        assert impls["liger"].cls is liger_cls
        assert registry.select(category, variant).cls is torch_cls  # never chosen unasked


@pytest.mark.parametrize("how", ["environment", "preferences"])
@pytest.mark.parametrize("entry", list(ENTRIES), ids="/".join)
def test_asking_for_liger_without_it_builds_torch_and_says_so_once(entry, how, monkeypatch,
                                                                     caplog):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # as on CI, GPU or not
    torch.manual_seed(0)
    reference = AutoregressiveModel(tiny_config())
    ask_for_liger(monkeypatch, how, [entry])
    with caplog.at_level(logging.WARNING):
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            models.append(AutoregressiveModel(tiny_config()))
    lines = matformer_lines(caplog)
    assert len(lines) == 1, lines
    assert f"{'/'.join(entry)} implementation 'liger'" in lines[0] and "'torch'" in lines[0]
    torch_cls, _ = ENTRIES[entry]
    assert type(built(models[0], entry[0])) is torch_cls
    ids = torch.randint(0, 90, (2, 12))
    with torch.no_grad():
        assert torch.equal(models[1](ids), reference(ids))
        assert torch.equal(models[1].loss(ids), reference.loss(ids))


def pretend_liger_is_installed(monkeypatch) -> None:
    """Let the registry build the liger modules here; they meet only CPU tensors."""
    real = Implementation.unavailable_reason
    monkeypatch.setattr(Implementation, "unavailable_reason",
                        lambda impl: None if impl.name == "liger" else real(impl))


def test_liger_modules_keep_canonical_names_and_hand_cpu_tensors_to_torch(monkeypatch, caplog):
    torch.manual_seed(0)
    reference = AutoregressiveModel(tiny_config())
    pretend_liger_is_installed(monkeypatch)
    ask_for_liger(monkeypatch, "preferences")
    torch.manual_seed(0)
    model = AutoregressiveModel(tiny_config())
    for (category, _), (_, liger_cls) in ENTRIES.items():
        assert type(built(model, category)) is liger_cls
    assert list(model.state_dict()) == list(reference.state_dict())
    for name, tensor in reference.state_dict().items():
        assert torch.equal(model.state_dict()[name], tensor), name  # same init, same order
    ids = torch.randint(0, 90, (2, 12))
    with caplog.at_level(logging.WARNING):
        for tier in (0, 1):  # a nested width too; two passes, still one line per entry
            loss = model.loss(ids, tier=tier, reduction="sum")
            want = reference.loss(ids, tier=tier, reduction="sum")
            assert torch.equal(loss, want)
            grads = torch.autograd.grad(loss, list(model.parameters()))
            want_grads = torch.autograd.grad(want, list(reference.parameters()))
            for got, expected in zip(grads, want_grads, strict=True):
                assert torch.equal(got, expected)
    lines = matformer_lines(caplog)
    assert sorted(lines) == sorted(
        f"matformer: liger {category}/{variant} needs CUDA tensors; using torch for such inputs"
        for category, variant in ENTRIES
    )


@pytest.mark.cuda
@pytest.mark.skipif(not LIGER_INSTALLED, reason="needs liger-kernel (pip install -e '.[cuda]')")
class TestOnCuda:
    """Each liger entry against its torch entry, outputs and gradients."""

    @staticmethod
    def twins(entry, config, dtype=torch.float32):
        """The torch and liger modules of an entry, with the same (randomised) weights."""
        torch_cls, liger_cls = ENTRIES[entry]
        assert registry.select(*entry, "liger").cls is liger_cls
        reference = torch_cls(config).cuda()
        with torch.no_grad():
            for param in reference.parameters():  # norm weights away from 1 too
                param.add_(torch.randn_like(param) * 0.1)
        fused = liger_cls(config).cuda()
        fused.load_state_dict(reference.state_dict())
        return reference.to(dtype), fused.to(dtype)

    @staticmethod
    def close(got, want, dtype):
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
            return
        # bf16 keeps 8 bits: a sum of hundreds of products rounded in another order is off by
        # a few ulps of the sum's scale, not of each (possibly tiny) element
        scale = max(want.detach().float().abs().max().item(), 1.0)
        torch.testing.assert_close(got, want, atol=2e-2 * scale, rtol=2e-2)
        error = (got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12)
        assert error.item() < 1e-2, f"relative error {error.item():.2e} over the whole tensor"

    @staticmethod
    def agree(reference, fused, inputs, args, dtype):
        """Same output, and same gradients for the inputs and every parameter."""
        leaves = [x.detach().clone().requires_grad_() for x in inputs]
        twins = [x.detach().clone().requires_grad_() for x in inputs]
        want = reference(*leaves, *args)
        got = fused(*twins, *args)
        TestOnCuda.close(got, want, dtype)
        grad = torch.randn_like(want)
        want_grads = torch.autograd.grad(want, [*leaves, *reference.parameters()], grad)
        got_grads = torch.autograd.grad(got, [*twins, *fused.parameters()], grad)
        for g, w in zip(got_grads, want_grads, strict=True):
            TestOnCuda.close(g, w, dtype)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    def test_rmsnorm(self, dtype):
        reference, fused = self.twins(("norm", "rmsnorm"), tiny_config(hidden_size=256), dtype)
        x = torch.randn(4, 16, 256, device="cuda", dtype=dtype)
        self.agree(reference, fused, [x], [], dtype)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("width", [512, 128])
    def test_swiglu_at_each_width(self, dtype, width):
        config = tiny_config(hidden_size=256, intermediate_size=512)
        reference, fused = self.twins(("mlp", "swiglu"), config, dtype)
        x = torch.randn(4, 16, 256, device="cuda", dtype=dtype)
        self.agree(reference, fused, [x], [width], dtype)
        out = fused(x.requires_grad_(), width)
        out.sum().backward()
        assert not fused.up_proj.weight.grad[width:].any()  # the tail gets exactly 0

    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
    @pytest.mark.parametrize("reduction", ["mean", "sum"])
    def test_cross_entropy(self, dtype, reduction):
        reference, fused = self.twins(("loss", "cross_entropy"), None)
        logits = torch.randn(2, 16, 1000, device="cuda", dtype=dtype)
        labels = torch.randint(0, 1000, (2, 16), device="cuda")
        labels[0, :5] = IGNORE_INDEX
        self.agree(reference, fused, [logits], [labels, reduction], dtype)
        none = torch.full_like(labels, IGNORE_INDEX)
        assert fused(logits, none, reduction).isnan().item() == (reduction == "mean")

    def test_whole_model(self, monkeypatch):
        torch.manual_seed(0)
        reference = AutoregressiveModel(tiny_config()).cuda()
        ask_for_liger(monkeypatch, "preferences")
        model = AutoregressiveModel(tiny_config()).cuda()
        model.load_state_dict(reference.state_dict())
        for (category, _), (_, liger_cls) in ENTRIES.items():
            assert type(built(model, category)) is liger_cls
        ids = torch.randint(0, 90, (2, 12), device="cuda")
        for tier in (0, 1):
            loss = model.loss(ids, tier=tier)
            want = reference.loss(ids, tier=tier)
            self.close(loss, want, torch.float32)
            grads = torch.autograd.grad(loss, list(model.parameters()))
            want_grads = torch.autograd.grad(want, list(reference.parameters()))
            for got, expected in zip(grads, want_grads, strict=True):
                self.close(got, expected, torch.float32)
