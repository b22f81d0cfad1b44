import copy
import math

import pytest
import torch
from torch import nn

from matformer.modeling.optim import (
    OPTIMIZER_NAMES,
    LocalOptimizer,
    OptimizerConfig,
    OptimizerConfigError,
    lr_factor,
)


class TinyLM(nn.Module):
    """Embedding, one hidden matrix, a norm and a head: one parameter of each kind."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.hidden = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 10)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(torch.relu(self.hidden(self.embed(ids)))))


def _model() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()


def _loss(model: nn.Module) -> torch.Tensor:
    ids = torch.arange(10).repeat(4)
    return nn.functional.cross_entropy(model(ids), (ids + 3) % 10)


def _train(model: nn.Module, opt: LocalOptimizer, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        _loss(model).backward()
        opt.step()


SCHEDULE = dict(warmup_steps=10, total_steps=110, min_ratio=0.1)


@pytest.mark.parametrize(
    ("step", "schedule", "expected"),
    [
        (0, "cosine", 0.1),  # first update: 1/warmup_steps
        (4, "cosine", 0.5),  # warmup midpoint
        (9, "cosine", 1.0),  # last warmup step reaches the peak
        (10, "cosine", 1.0),  # decay starts from the peak
        (60, "cosine", (1 + 0.1) / 2),  # cosine midpoint
        (35, "cosine", 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4))),
        (110, "cosine", 0.1),  # end of decay
        (10_000, "cosine", 0.1),  # constant afterwards
        (60, "linear", (1 + 0.1) / 2),
        (35, "linear", 1 - 0.25 * 0.9),
        (110, "linear", 0.1),
        (4, "constant", 0.5),
        (60, "constant", 1.0),
        (10_000, "constant", 1.0),
    ],
)
def test_lr_factor_at_exact_points(step: int, schedule: str, expected: float) -> None:
    assert lr_factor(step, schedule=schedule, **SCHEDULE) == pytest.approx(expected)


def test_lr_factor_without_warmup_starts_at_peak() -> None:
    assert lr_factor(0, warmup_steps=0, total_steps=5, schedule="linear", min_ratio=0.0) == 1.0
    assert lr_factor(5, warmup_steps=5, total_steps=5, schedule="cosine", min_ratio=0.2) == 0.2


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_each_optimizer_reduces_loss(name: str) -> None:
    model = _model()
    config = OptimizerConfig(name=name, lr=1e-2, weight_decay=0.01, schedule="constant")
    opt = config.build(model)
    before = _loss(model).item()
    _train(model, opt, 20)
    assert _loss(model).item() < 0.8 * before


def test_schedule_drives_the_learning_rate() -> None:
    model = _model()
    config = OptimizerConfig(lr=1e-2, final_lr=1e-3, warmup_steps=4, total_steps=8)
    opt = config.build(model)
    assert opt.lr == pytest.approx(1e-2 / 4)
    _train(model, opt, 4)
    assert opt.lr == pytest.approx(1e-2)
    _train(model, opt, 10)
    assert opt.lr == pytest.approx(1e-3)


def test_muon_holds_exactly_the_hidden_matrices() -> None:
    model = _model()
    opt = OptimizerConfig(name="muon", weight_decay=0.1).build(model)
    muon = [o for o in opt.optimizers if isinstance(o, torch.optim.Muon)]
    adamw = [o for o in opt.optimizers if isinstance(o, torch.optim.AdamW)]
    assert len(muon) == 1 and len(adamw) == 1 and len(opt.optimizers) == 2

    def held(o: torch.optim.Optimizer) -> set[int]:
        return {id(p) for g in o.param_groups for p in g["params"]}

    assert held(muon[0]) == {id(model.hidden.weight)}
    rest = {id(p) for p in model.parameters()} - {id(model.hidden.weight)}
    assert held(adamw[0]) == rest
    assert muon[0].param_groups[0]["weight_decay"] == 0.1


def test_muon_needs_a_recent_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch.optim, "Muon")
    with pytest.raises(OptimizerConfigError, match=r"torch >= 2\.9"):
        OptimizerConfig(name="muon").build(_model())


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_no_weight_decay_on_vectors(name: str) -> None:
    model = _model()
    opt = OptimizerConfig(name=name, weight_decay=0.1).build(model)
    decayed = {
        id(p)
        for o in opt.optimizers
        for g in o.param_groups
        if g["weight_decay"] > 0
        for p in g["params"]
    }
    for pname, p in model.named_parameters():
        assert (id(p) in decayed) == (p.ndim >= 2), pname


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"name": "sgd"}, "adam, adamw, muon"),
        ({"schedule": "step"}, "cosine, linear, constant"),
        ({"lr": -1.0}, "lr must be > 0"),
        ({"warmup_steps": 20, "total_steps": 10}, "must not exceed total_steps"),
        ({"final_lr": 1.0, "lr": 0.1}, "final_lr"),
        ({"betas": (0.9, 1.5)}, "betas"),
    ],
)
def test_bad_config_is_rejected(fields: dict, message: str) -> None:
    with pytest.raises(OptimizerConfigError, match=message):
        OptimizerConfig(**fields)


def test_lr_factor_rejects_unknown_schedule() -> None:
    with pytest.raises(OptimizerConfigError, match="cosine, linear, constant"):
        lr_factor(0, warmup_steps=0, total_steps=1, schedule="exp", min_ratio=0.0)


@pytest.mark.parametrize("name", OPTIMIZER_NAMES)
def test_state_dict_round_trip_resumes_identically(name: str) -> None:
    config = OptimizerConfig(name=name, lr=1e-2, warmup_steps=3, total_steps=12)
    model = _model()
    opt = config.build(model)
    _train(model, opt, 4)

    resumed_model = copy.deepcopy(model)
    resumed = config.build(resumed_model)
    resumed.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert resumed.lr == opt.lr

    _train(model, opt, 3)
    _train(resumed_model, resumed, 3)
    assert resumed.lr == opt.lr
    for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_state_from_another_optimizer_is_rejected() -> None:
    state = OptimizerConfig(name="muon").build(_model()).state_dict()
    with pytest.raises(OptimizerConfigError, match=r"same OptimizerConfig\.name"):
        OptimizerConfig(name="adamw").build(_model()).load_state_dict(state)
