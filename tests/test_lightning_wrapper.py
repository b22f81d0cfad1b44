"""A Matformer model under Lightning's Trainer (modeling/lightning_wrapper.py): its steps
give the weights our own loop gives on the same token-budget batches, for each optimizer;
the tail neurons of tier 0 learn only when tier 0 trains; and Lightning stays an extra."""

from __future__ import annotations

import ast
import copy
import importlib
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from support.models import tiny_config

from matformer.modeling import AutoregressiveModel, build_model
from matformer.modeling.batching import AdaptiveLimitsConfig, MicrobatchRunner
from matformer.modeling.budget_sampler import token_budget_loader
from matformer.modeling.optim import OptimizerConfig
from matformer.modeling.training import TierSchedule, train_step_on_examples

REPO = Path(__file__).resolve().parent.parent
WRAPPER = "matformer.modeling.lightning_wrapper"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def lightning():
    return pytest.importorskip("lightning")


def _documents(count: int = 24) -> list[torch.Tensor]:
    draw = torch.Generator().manual_seed(0)
    return [torch.randint(3, 90, (int(n),), generator=draw)
            for n in torch.randint(2, 24, (count,), generator=draw)]


def _fit(lightning, module, loader, max_steps: int, callbacks=()) -> None:
    lightning.Trainer(max_steps=max_steps, accelerator="cpu", logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, callbacks=list(callbacks)).fit(module, loader)


@pytest.mark.parametrize(("name", "causal"), [("adam", True), ("adamw", True), ("muon", True),
                                             ("adamw", False)])
def test_lightning_steps_give_the_weights_of_our_own_loop(lightning, name, causal):
    from matformer.modeling.lightning_wrapper import MatformerLightningModule

    torch.manual_seed(0)
    model = build_model(tiny_config(is_causal=causal))
    twin = copy.deepcopy(model)
    before = copy.deepcopy(model.state_dict())
    config = OptimizerConfig(name=name, lr=1e-2, weight_decay=0.01, warmup_steps=1,
                             total_steps=6)
    schedule = TierSchedule(tiers=[0, 2, [0, 1]], weights=[1.0, 0.5, 0.25])
    limits = AdaptiveLimitsConfig(max_tokens=48, max_examples=3)  # several microbatches each
    loader = token_budget_loader(_documents(), max_tokens=128, seed=1)
    module = MatformerLightningModule(model, config, schedule=schedule, limits=limits,
                                      max_grad_norm=0.5)
    steps, optimizers = 3, len(config.build(copy.deepcopy(model)).optimizers)
    # Lightning counts each optimizer's step: muon's two make max_steps count two a batch.
    _fit(lightning, module, loader, max_steps=steps * optimizers)

    loader.batch_sampler.set_epoch(0)
    runner = MicrobatchRunner(twin, limits.build())
    optimizer = config.build(twin)
    for step, batch in zip(range(steps), loader, strict=False):
        train_step_on_examples(runner, optimizer, batch, schedule, step, max_grad_norm=0.5)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, twin.state_dict()[key], msg=key)
    assert not torch.equal(model.lm_head.weight, before["lm_head.weight"])


def _tail_gradients(lightning, tiers: list[int]) -> list[float]:
    """The size of the gradient on the tier-0-only FFN neurons, at each step of a short run."""
    from matformer.modeling.lightning_wrapper import MatformerLightningModule

    torch.manual_seed(0)
    model = AutoregressiveModel(tiny_config())
    half = model.config.matformer_base_intermediate_size // 2  # tier 1 uses the first half

    class TailProbe(lightning.Callback):
        def __init__(self) -> None:
            self.sizes: list[float] = []

        def on_before_optimizer_step(self, trainer, module, optimizer) -> None:
            total = 0.0
            for layer in model.model.layers:
                mlp = layer.mlp
                total += float(mlp.up_proj.weight.grad[half:].abs().sum()
                               + mlp.gate_proj.weight.grad[half:].abs().sum()
                               + mlp.down_proj.weight.grad[:, half:].abs().sum())
            self.sizes.append(total)

    probe = TailProbe()
    module = MatformerLightningModule(model, OptimizerConfig(name="adamw", lr=1e-2),
                                      schedule=TierSchedule(tiers=tiers))
    _fit(lightning, module, token_budget_loader(_documents(), max_tokens=128), max_steps=2,
         callbacks=[probe])
    return probe.sizes


def test_tier_zero_tail_neurons_learn_only_when_tier_zero_trains(lightning):
    assert _tail_gradients(lightning, [1, 2]) == [0.0, 0.0]
    assert all(size > 0 for size in _tail_gradients(lightning, [0, 1]))


def test_each_epoch_trains_every_document_once_in_a_new_order(lightning):
    from matformer.modeling.lightning_wrapper import MatformerLightningModule

    documents = [torch.cat([torch.tensor([3 + i]), doc]) for i, doc in enumerate(_documents(12))]

    class Seen(lightning.Callback):
        def __init__(self) -> None:
            self.epochs: dict[int, list[int]] = {}

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            firsts = [int(doc[0]) - 3 for doc in batch]
            self.epochs.setdefault(trainer.current_epoch, []).extend(firsts)

    seen = Seen()
    module = MatformerLightningModule(AutoregressiveModel(tiny_config()), OptimizerConfig())
    lightning.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[seen]).fit(module, token_budget_loader(documents, 64))
    assert [sorted(order) for order in seen.epochs.values()] == [list(range(12))] * 2
    assert seen.epochs[0] != seen.epochs[1]


def test_without_lightning_the_import_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.delitem(sys.modules, WRAPPER, raising=False)
    with pytest.raises(ImportError, match=r"pip install 'matformer\[lightning\]'"):
        importlib.import_module(WRAPPER)


def test_lightning_is_an_extra_that_only_its_wrapper_imports():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert not any(dep.startswith("lightning") for dep in project["dependencies"])
    importers = []
    for folder in ("modeling", "server", "client", "relay", "scripts", "protocol",
                   "local_testnet", "matformer"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                         else [a.name for a in node.names] if isinstance(node, ast.Import)
                         else [])
                if any(n.split(".")[0] in ("lightning", "pytorch_lightning") for n in names):
                    importers.append(str(path.relative_to(REPO)))
    assert sorted(set(importers)) == ["modeling/lightning_wrapper.py"]
