"""Local optimizers for standalone training and baselines.

`OptimizerConfig` is plain data (it round-trips through JSON/TOML); `build()` turns it into a
`LocalOptimizer`, which steps one or more torch optimizers and their learning-rate schedules
as a single unit, so training loops never need to know whether Muon is in play.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from matformer.modeling.errors import ConfigError

OPTIMIZER_NAMES = ("adam", "adamw", "muon")

# How the multiplier falls from 1 to 0 as decay progress runs from 0 to 1; "constant" has no decay.
_DECAY_SHAPES: dict[str, Callable[[float], float]] = {
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
    "linear": lambda progress: 1.0 - progress,
}
SCHEDULES = (*_DECAY_SHAPES, "constant")

# Parameters whose names contain these stay on AdamW under "muon": embeddings and output heads
# are lookups/classifiers rather than hidden linear maps, which is what Muon's orthogonalised
# update is designed for.
_MUON_EXCLUDED_NAMES = ("embed", "lm_head")


class OptimizerConfigError(ConfigError):
    """An optimizer config or saved optimizer state that cannot be used as given."""


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    name: str = "adamw"  # one of OPTIMIZER_NAMES
    lr: float = 3e-4  # peak learning rate, reached at the end of warmup
    final_lr: float = 0.0  # learning rate at total_steps, where the decay ends
    weight_decay: float = 0.0  # applied only to parameters with ndim >= 2
    betas: tuple[float, float] = (0.9, 0.95)  # Adam moment decay rates
    eps: float = 1e-8  # Adam denominator floor
    warmup_steps: int = 0  # steps of linear warmup from ~0 to lr
    hold_steps: int = 0  # steps at lr after warmup, before the decay begins
    total_steps: int = 1000  # step at which the decay reaches final_lr
    schedule: str = "cosine"  # one of SCHEDULES; the shape of the decay after warmup
    muon_momentum: float = 0.95  # Muon's momentum; only used when name == "muon"

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZER_NAMES:
            raise OptimizerConfigError(
                f"unknown optimizer name {self.name!r}; choose one of {', '.join(OPTIMIZER_NAMES)}"
            )
        _check_schedule(self.schedule)
        # Stored configs come back from JSON as lists; keep the declared type.
        self.betas = tuple(float(b) for b in self.betas)  # type: ignore[assignment]
        checks = [
            (self.lr > 0, f"lr must be > 0, got {self.lr}"),
            (
                0 <= self.final_lr <= self.lr,
                f"final_lr must lie in [0, lr={self.lr}], got {self.final_lr}",
            ),
            (self.weight_decay >= 0, f"weight_decay must be >= 0, got {self.weight_decay}"),
            (
                len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                f"betas must be two numbers in [0, 1), got {self.betas}",
            ),
            (self.eps > 0, f"eps must be > 0, got {self.eps}"),
            (self.warmup_steps >= 0, f"warmup_steps must be >= 0, got {self.warmup_steps}"),
            (self.hold_steps >= 0, f"hold_steps must be >= 0, got {self.hold_steps}"),
            (self.total_steps >= 1, f"total_steps must be >= 1, got {self.total_steps}"),
            (
                self.warmup_steps + self.hold_steps <= self.total_steps,
                f"warmup_steps ({self.warmup_steps}) and hold_steps ({self.hold_steps}) must "
                f"not exceed total_steps ({self.total_steps}); lower them or raise total_steps",
            ),
            (
                0 <= self.muon_momentum < 1,
                f"muon_momentum must lie in [0, 1), got {self.muon_momentum}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise OptimizerConfigError(message)

    def build(self, model: torch.nn.Module) -> LocalOptimizer:
        """Create the optimizer(s) for `model`'s trainable parameters."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise OptimizerConfigError(
                "the model has no trainable parameters; unfreeze some (requires_grad=True) "
                "before building an optimizer"
            )
        optimizers: list[torch.optim.Optimizer] = []
        if self.name == "muon":
            muon_cls = _muon_class()
            hidden = [p for n, p in named if _is_muon_param(n, p)]
            named = [(n, p) for n, p in named if not _is_muon_param(n, p)]
            if hidden:
                # match_rms_adamw rescales Muon's update to AdamW's size, so one lr serves both.
                optimizers.append(
                    muon_cls(
                        hidden,
                        lr=self.lr,
                        weight_decay=self.weight_decay,
                        momentum=self.muon_momentum,
                        adjust_lr_fn="match_rms_adamw",
                    )
                )
        groups = _decay_groups([p for _, p in named], self.weight_decay)
        if groups:
            # Plain Adam adds the decay to the gradient (L2); AdamW decouples it from the update.
            adam_cls = torch.optim.Adam if self.name == "adam" else torch.optim.AdamW
            optimizers.append(adam_cls(groups, lr=self.lr, betas=self.betas, eps=self.eps))

        # Capture the values now so later edits to this config cannot move a running schedule.
        warmup, hold, total = self.warmup_steps, self.hold_steps, self.total_steps
        shape, min_ratio = self.schedule, self.final_lr / self.lr

        def schedule(step: int) -> float:
            return lr_factor(step, warmup_steps=warmup, total_steps=total, schedule=shape,
                             min_ratio=min_ratio, hold_steps=hold)

        return LocalOptimizer(optimizers, schedule)


class LocalOptimizer:
    """Several torch optimizers, each with a LambdaLR schedule, stepped as one."""

    def __init__(
        self, optimizers: Sequence[torch.optim.Optimizer], lr_lambda: Callable[[int], float]
    ) -> None:
        if not optimizers:
            raise OptimizerConfigError("LocalOptimizer needs at least one torch optimizer")
        self.optimizers = tuple(optimizers)
        self.scale = 1.0  # a multiplier on the schedule's lr, set from outside (scale_lr)

        def scaled(step: int) -> float:  # a plain function: LambdaLR saves no state of it
            return lr_lambda(step) * self.scale

        self._scaled = scaled
        self.schedulers = tuple(
            torch.optim.lr_scheduler.LambdaLR(opt, scaled) for opt in self.optimizers
        )

    def scale_lr(self, scale: float) -> None:
        """Multiply the schedule's lr by ``scale`` from the next update on, until the next
        call: a federated client's inner lr follows the run's rounds as well as its own steps.
        Not part of ``state_dict``; whoever sets it sets it again after a restore."""
        self.scale = scale
        for sched in self.schedulers:
            for group, base in zip(sched.optimizer.param_groups, sched.base_lrs, strict=True):
                group["lr"] = base * self._scaled(sched.last_epoch)

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()
        # Schedulers advance after the update, so update k runs at lr_lambda(k).
        for sched in self.schedulers:
            sched.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    @property
    def lr(self) -> float:
        """The learning rate the next update will use (first group of the first optimizer)."""
        return float(self.optimizers[0].param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizers": [opt.state_dict() for opt in self.optimizers],
            "schedulers": [sched.state_dict() for sched in self.schedulers],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = len(state["optimizers"])
        if saved != len(self.optimizers) or len(state["schedulers"]) != len(self.schedulers):
            raise OptimizerConfigError(
                f"saved state holds {saved} optimizer(s) but this one has "
                f"{len(self.optimizers)}; build it from the same OptimizerConfig.name and model "
                "that produced the state"
            )
        for opt, opt_state in zip(self.optimizers, state["optimizers"], strict=True):
            opt.load_state_dict(opt_state)
        for sched, sched_state in zip(self.schedulers, state["schedulers"], strict=True):
            sched.load_state_dict(sched_state)


def constant_after_warmup(
    name: str, *, lr: float, weight_decay: float, betas: tuple[float, float], eps: float,
    warmup_steps: int,
) -> OptimizerConfig:
    """An optimizer whose lr is constant after ``warmup_steps``: a federated client's inner
    optimizer under local steps, which has no planned end to decay towards."""
    return OptimizerConfig(name=name, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps,
                           warmup_steps=warmup_steps, total_steps=max(warmup_steps, 1),
                           schedule="constant")


def lr_factor(
    step: int, *, warmup_steps: int, total_steps: int, schedule: str, min_ratio: float,
    hold_steps: int = 0,
) -> float:
    """Multiplier on the peak learning rate for update number `step` (0-based).

    Warmup is linear: step k < warmup_steps gives (k + 1) / warmup_steps, so the very first
    update already moves (by 1/warmup_steps of the peak) and step warmup_steps - 1 reaches 1.
    It holds at 1 for `hold_steps` more; then "cosine" and "linear" fall from 1 to
    `min_ratio` at `total_steps` and stay there; "constant" stays at 1.
    """
    _check_schedule(schedule)
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_from = warmup_steps + hold_steps
    if schedule == "constant" or step < decay_from:
        return 1.0
    if step >= total_steps:
        return min_ratio
    progress = (step - decay_from) / (total_steps - decay_from)
    return min_ratio + (1.0 - min_ratio) * _DECAY_SHAPES[schedule](progress)


def _check_schedule(schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise OptimizerConfigError(
            f"unknown schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}"
        )


def _is_muon_param(name: str, param: torch.Tensor) -> bool:
    return param.ndim == 2 and not any(part in name for part in _MUON_EXCLUDED_NAMES)


def _decay_groups(params: list[torch.Tensor], weight_decay: float) -> list[dict[str, Any]]:
    # Norm gains and biases are not decayed: shrinking them toward 0 only hurts the fit.
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def _muon_class() -> type[torch.optim.Optimizer]:
    muon = getattr(torch.optim, "Muon", None)
    if muon is None:
        raise OptimizerConfigError(
            f"optimizer 'muon' needs torch >= 2.9 (torch.optim.Muon); found torch "
            f"{torch.__version__}. Upgrade torch or use name='adamw'."
        )
    return muon
