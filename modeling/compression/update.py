"""Update rules: how an aggregate moves the weights (DESIGN.md §5.5).

- ``sgd``:  w ← w·(1 − lr·wd) − lr·agg
- ``sign``: w ← w·(1 − lr·wd) − lr·sign(agg)   (DeMo, decoupled weight decay)

Only covered elements change. Rules work element by element, so the coordinator applying a
rule to the master weights and a client applying it to its tier slice compute the same
numbers: replicas stay equal without sending weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from modeling.compression.aggregation import Aggregate
from modeling.compression.grid import Region, region_slices
from modeling.errors import CompressionConfigError

Rule = Callable[..., Tensor]  # (weight, values, covered, *, lr, weight_decay) → new weight


def sgd(
    weight: Tensor, values: Tensor, covered: Tensor, *, lr: float, weight_decay: float = 0.0
) -> Tensor:
    """``weight`` moved by ``-lr·values`` where ``covered``; a new tensor of weight's dtype."""
    decayed = weight * (1.0 - lr * weight_decay)  # × 1.0 is exact when weight_decay is 0
    # add with alpha is the kernel torch.optim.SGD steps with: same numbers as standalone SGD
    return torch.where(covered, torch.add(decayed, values, alpha=-lr), weight).to(weight.dtype)


def sign(
    weight: Tensor, values: Tensor, covered: Tensor, *, lr: float, weight_decay: float = 0.0
) -> Tensor:
    """``weight`` moved by ``-lr·sign(values)`` where ``covered``, with decoupled decay."""
    return sgd(weight, torch.sign(values), covered, lr=lr, weight_decay=weight_decay)


UPDATE_RULES: dict[str, Rule] = {"sgd": sgd, "sign": sign}


@dataclass(kw_only=True, slots=True)
class UpdateConfig:
    rule: str = "sign"  # one of UPDATE_RULES
    lr: float  # step size of the update
    weight_decay: float = 0.0  # decoupled: w ← w·(1 − lr·wd) on covered elements

    def __post_init__(self) -> None:
        if self.rule not in UPDATE_RULES:
            raise CompressionConfigError(
                f"unknown update rule {self.rule!r}; choose one of {', '.join(UPDATE_RULES)}."
            )
        if self.lr <= 0 or self.weight_decay < 0:
            raise CompressionConfigError(
                f"lr must be > 0 and weight_decay >= 0, got {self.lr} and {self.weight_decay}."
            )

    def build(self) -> UpdateRule:
        return UpdateRule(rule=UPDATE_RULES[self.rule], lr=self.lr, weight_decay=self.weight_decay)


@dataclass(frozen=True, slots=True)
class UpdateRule:
    rule: Rule
    lr: float
    weight_decay: float

    def apply(self, weight: Tensor, update: Aggregate) -> Tensor:
        """The universal (master) weight after the update."""
        return self.rule(
            weight, update.values, update.covered, lr=self.lr, weight_decay=self.weight_decay
        )

    def apply_to_slice(self, weight: Tensor, update: Aggregate, region: Region) -> Tensor:
        """A client's tier slice (``region`` of the universal tensor) after the update; equal
        to ``apply(master, update)[region_slices(region)]``."""
        where = region_slices(region)
        return self.rule(
            weight, update.values[where], update.covered[where], lr=self.lr,
            weight_decay=self.weight_decay,
        )
