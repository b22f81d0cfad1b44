"""``outer_adamw``: the token-weighted mean of the members' results taken as a gradient by
an outer Adam (Kingma & Ba; decoupled weight decay from ``[update] weight_decay`` through the
rule, as AdamW): per element ``m ← β₁m + (1−β₁)g``, ``v ← β₂v + (1−β₂)g²``, and the step moves
along ``m̂ / (√v̂ + ε)`` with ``[update] lr`` under ``rule = "sgd"``. DiLoCo's ablations try it
in place of outer Nesterov. An element no result covers keeps its moments and its count and
does not move; the bias correction counts the rounds each element was covered in, so a
tier-0-only element is corrected by its own count. Its state (``exp_avg``, ``exp_avg_sq``,
``step``: three float32 copies of the model) is carried, saved with every checkpoint and
rebuilt on resume like the momentum."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from matformer.modeling.compression import Step, UpdateRule
from matformer.modeling.settings import setting
from matformer.server.aggregation import Aggregate, aggregate
from matformer.server.errors import InvalidValue
from matformer.server.policies.base import Results, RoundPolicy
from matformer.server.sections.checks import require
from matformer.server.update_steps import Carried, broadcast_step

KINDS = ("exp_avg", "exp_avg_sq", "step")


@dataclass(kw_only=True, slots=True, frozen=True)
class AdamOptions:
    beta1: float = setting(0.9, low=0, high=1, help="the first moment's decay, below 1")
    beta2: float = setting(0.95, low=0, high=1, help="the second moment's decay, below 1")
    eps: float = setting(1e-8, low=0, above=True, high=1, help="added to √v̂")

    def __post_init__(self) -> None:
        require(self.beta1 < 1 and self.beta2 < 1,
                f"[policy.options] beta1 and beta2 must lie in [0, 1), got {self.beta1}, "
                f"{self.beta2}.")


class OuterAdamW(RoundPolicy):
    name = "outer_adamw"
    Options = AdamOptions

    @classmethod
    def build(cls, options: Any, update: Any, *, peer_clip: float) -> OuterAdamW:
        if update.rule != "sgd" or update.momentum or update.vote != "mean":
            raise InvalidValue(
                "[policy] name = \"outer_adamw\" steps along Adam's direction, so [update] "
                "needs rule = \"sgd\", no momentum and vote = \"mean\"; got rule "
                f"{update.rule!r}, momentum {update.momentum}, vote {update.vote!r}.")
        return cls(options, peer_clip=peer_clip)

    def close(self, rule: UpdateRule, master: Mapping[str, Tensor], by_name: Results,
              carried: Carried | None = None
              ) -> tuple[dict[str, Tensor], dict[str, Step], Carried]:
        o = self.options
        master, carried = dict(master), carried or Carried()
        residual, steps = dict(carried.residual), {}
        state = {kind: dict(carried.buffers.get(kind, {})) for kind in KINDS}
        for name, results in by_name.items():
            mean = aggregate(results)
            g, covered = mean.values.float(), mean.covered
            zeros = torch.zeros_like(g)
            m, v, t = (state[kind].get(name, zeros) for kind in KINDS)
            t = torch.where(covered, t + 1, t)
            m = torch.where(covered, m * o.beta1 + g * (1 - o.beta1), m)
            v = torch.where(covered, v * o.beta2 + g * g * (1 - o.beta2), v)
            seen = t.clamp(min=1)
            direction = (m / (1 - o.beta1 ** seen)) / (
                torch.sqrt(v / (1 - o.beta2 ** seen)) + o.eps)
            state["exp_avg"][name], state["exp_avg_sq"][name], state["step"][name] = m, v, t
            step, left, decoded = broadcast_step(
                rule, Aggregate(values=torch.where(covered, direction, 0.0), tokens=mean.tokens),
                [r.region for r in results], residual.get(name))
            if left is not None:
                residual[name] = left
            master[name] = rule.apply(master[name], step, direction=decoded)
            steps[name] = step
        return master, steps, Carried(residual=residual, momentum=dict(carried.momentum),
                                      buffers={**carried.buffers, **state})

    def carries_state(self, broadcast_topk: int) -> bool:
        return True
