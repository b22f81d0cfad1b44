"""Update rules: how an aggregate moves the weights (docs/architecture.md, "The update record").

- ``sgd``:  w ← w·(1 − lr·wd) − lr·agg
- ``sign``: w ← w·(1 − lr·wd) − lr·sign(agg)   (DeMo, decoupled weight decay)

Only covered elements change. A rule moves weights along a step's direction (``steps.py``)
element by element, so the coordinator applying it to the master weights and a client
applying it to its tier slice compute the same numbers: replicas stay equal without sending
weights. ``RoundUpdate`` is the record of a round that every side shares. What only the
coordinator computes, the step's form (exact, or compressed for the broadcast) from a round's
aggregate, lives in ``server/update_steps.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from matformer.modeling.compression.grid import Region, full_region
from matformer.modeling.compression.steps import (
    Broadcast,
    CoefficientStep,
    Step,
    intersect,
    within,
)
from matformer.modeling.errors import CompressionConfigError

# (weight, values, covered | None, *, lr, weight_decay, out=None) → the moved weight
Rule = Callable[..., Tensor]


def sgd(
    weight: Tensor, values: Tensor, covered: Tensor | None, *, lr: float,
    weight_decay: float = 0.0, out: Tensor | None = None,
) -> Tensor:
    """``weight`` moved by ``-lr·values`` where ``covered`` (None: everywhere): a new tensor
    of weight's dtype, or written into ``out`` (weight-shaped, not overlapping the inputs)
    and returned; the same bits either way."""
    decayed = weight * (1.0 - lr * weight_decay) if weight_decay else weight  # × 1 is exact
    # add with alpha is the kernel torch.optim.SGD steps with: same numbers as standalone SGD
    if out is not None and covered is None and out.dtype == weight.dtype \
            and torch.result_type(decayed, values) == weight.dtype:
        return torch.add(decayed, values, alpha=-lr, out=out)
    moved = torch.add(decayed, values, alpha=-lr)
    moved = (moved if covered is None else torch.where(covered, moved, weight)).to(weight.dtype)
    return moved if out is None else out.copy_(moved)


def sign(
    weight: Tensor, values: Tensor, covered: Tensor | None, *, lr: float,
    weight_decay: float = 0.0, out: Tensor | None = None,
) -> Tensor:
    """``weight`` moved by ``-lr·sign(values)`` where ``covered``, with decoupled decay."""
    return sgd(weight, torch.sign(values), covered, lr=lr, weight_decay=weight_decay, out=out)


UPDATE_RULES: dict[str, Rule] = {"sgd": sgd, "sign": sign}


@dataclass(kw_only=True, slots=True)
class UpdateConfig:
    rule: str = "sign"  # one of UPDATE_RULES
    lr: float  # step size of the update
    weight_decay: float = 0.0  # decoupled: w ← w·(1 − lr·wd) on covered elements
    # The coordinator's broadcast: top-k DCT coefficients per chunk of ``chunk`` (steps.py);
    # 0: the exact aggregate (float32, or int8 signs under ``sign``). Clients need neither.
    broadcast_topk: int = 0
    chunk: int = 64
    broadcast_bits: int = 8  # each kept coefficient's level (Broadcast.bits)

    def __post_init__(self) -> None:
        if self.rule not in UPDATE_RULES:
            raise CompressionConfigError(
                f"unknown update rule {self.rule!r}; choose one of {', '.join(UPDATE_RULES)}."
            )
        if self.lr <= 0 or self.weight_decay < 0:
            raise CompressionConfigError(
                f"lr must be > 0 and weight_decay >= 0, got {self.lr} and {self.weight_decay}."
            )
        if self.broadcast_topk < 0:
            raise CompressionConfigError(
                f"broadcast_topk must be >= 0 (0: exact), got {self.broadcast_topk}.")

    def build(self) -> UpdateRule:
        broadcast = Broadcast(topk=self.broadcast_topk, chunk=self.chunk,
                              bits=self.broadcast_bits) if self.broadcast_topk else None
        return UpdateRule(name=self.rule, rule=UPDATE_RULES[self.rule], lr=self.lr,
                          weight_decay=self.weight_decay, broadcast=broadcast)


@dataclass(frozen=True, slots=True)
class UpdateRule:
    name: str  # the key of ``rule`` in UPDATE_RULES
    rule: Rule
    lr: float
    weight_decay: float
    # how the coordinator compresses its steps (server/update_steps.py); None: exact steps
    broadcast: Broadcast | None = None

    def apply(self, weight: Tensor, step: Step, region: Region | None = None, *,
              direction: Tensor | None = None, out: Tensor | None = None) -> Tensor:
        """``weight`` (``region`` of the universal tensor; default: all of it) after
        ``step``: a new tensor of its dtype, equal to the same cut of the updated master.
        Only the part inside the step's box moves; ``direction``: ``step.direction`` of that
        part (``intersect(step.box, region)``) when the caller has it already.
        ``out``: a tensor of the weight's shape and dtype to write the result into instead
        (the weight itself: a replica moves its parameter in place, with no copy of it)."""
        region = full_region(step.shape) if region is None else region
        inside = intersect(step.box, region)
        if inside is None:
            return weight.clone() if out is None else out.copy_(weight)
        device = weight.device
        covered = None if step.covers(inside) else step.mask(inside).to(device)
        where = within(inside, region)
        if direction is None and isinstance(step, CoefficientStep):
            return self._apply_blocks(weight, step, inside, where, covered, out)
        direction = step.direction(inside) if direction is None else direction
        moved = self.rule(weight[where], direction.to(device), covered, lr=self.lr,
                          weight_decay=self.weight_decay)
        if inside == region:
            return moved if out is None else out.copy_(moved)
        if out is None:
            out = weight.clone()
        elif out is not weight:
            out.copy_(weight)
        out[where] = moved
        return out

    def _apply_blocks(self, weight: Tensor, step: CoefficientStep, inside: Region,
                      where: tuple[slice, ...], covered: Tensor | None,
                      out: Tensor | None) -> Tensor:
        """``apply`` of a compressed step, decoded a few rows of chunks at a time and each
        block moved as soon as it is decoded: the weight is read and the result written
        once, and the direction is never held whole. The rule is element by element, so
        the bits are those of moving the whole tensor at once, and ``out`` may be the
        weight itself. The step is decoded where the weight lies (a member training on its
        GPU decodes there): its sums are integers in float64, the same bits on any
        device."""
        if step.levels.device != weight.device:
            step = step.to(weight.device)
        moving = weight[where]
        if out is None:
            out = torch.empty_like(weight) if moving.shape == weight.shape else weight.clone()
        elif out is not weight and moving.shape != weight.shape:
            out.copy_(weight)  # what the step does not touch
        target = out[where]
        for rows, direction in step.decoded(inside):
            self.rule(moving[rows], direction.to(weight.device),
                      None if covered is None else covered[rows], lr=self.lr,
                      weight_decay=self.weight_decay, out=target[rows])
        return out


@dataclass(frozen=True, slots=True)
class RoundUpdate:
    """A round's update: logged by the coordinator, cut to a tier and sent, applied by every
    replica and replayed on resume; one record throughout."""

    round: int
    update: UpdateConfig  # rule, lr and weight decay it is applied with
    steps: dict[str, Step]  # canonical name → the parameter's step
    hashes: dict[int, str]  # tier → weight hash of the master after it
    coverage_tokens: dict[str, int] = field(default_factory=dict)  # Σ tokens behind a step

    def apply(self, state: Mapping[str, Tensor],
              regions: Mapping[str, Region] | None = None) -> dict[str, Tensor]:
        """``state`` (canonical names; ``regions[name]`` of each universal tensor, default
        all of it) after this update; names it does not touch unchanged."""
        rule = self.update.build()
        return {name: rule.apply(weight, self.steps[name],
                                 None if regions is None else regions[name])
                if name in self.steps else weight for name, weight in state.items()}

    def cut(self, tier: int, regions: Mapping[str, Region]) -> RoundUpdate:
        """What a client of ``tier`` holding ``regions`` downloads: its steps cut to them
        and its tier's hash."""
        steps = {}
        for name, step in self.steps.items():
            cut = step.cut(regions[name])
            if cut is not None:
                steps[name] = cut
        hashes = {tier: self.hashes[tier]} if tier in self.hashes else {}
        return RoundUpdate(round=self.round, update=self.update, steps=steps, hashes=hashes)

    @property
    def nbytes(self) -> int:
        return sum(step.nbytes for step in self.steps.values())
