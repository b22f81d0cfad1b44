"""``mean``: the token-weighted mean of the members' results (or, under ``[update] vote =
"majority"``, one sign vote each), through the outer momentum when ``[update] momentum`` is
set (DiLoCo's outer Nesterov SGD). The run's default, and the arithmetic of
``server.update_steps.close_round``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import Tensor

from matformer.modeling.compression import Step, UpdateRule
from matformer.server.policies.base import NoOptions, Results, RoundPolicy
from matformer.server.update_steps import Carried, Momentum, close_round


class TokenMean(RoundPolicy):
    name = "mean"

    def __init__(self, options: NoOptions | None = None, *, votes: bool = False,
                 momentum: Momentum | None = None, peer_clip: float = 0.0) -> None:
        super().__init__(options or NoOptions(), peer_clip=peer_clip)
        self.votes = votes
        self.momentum = momentum
        self.takes_partials = not votes  # a relay's sum carries no member's vote

    @classmethod
    def build(cls, options: Any, update: Any, *, peer_clip: float) -> TokenMean:
        return cls(options, votes=update.vote == "majority", momentum=update.momentum_of(),
                   peer_clip=peer_clip)

    def close(self, rule: UpdateRule, master: Mapping[str, Tensor], by_name: Results,
              carried: Carried | None = None
              ) -> tuple[dict[str, Tensor], dict[str, Step], Carried]:
        return close_round(rule, master, by_name, carried, votes=self.votes,
                           momentum=self.momentum)

    def carries_state(self, broadcast_topk: int) -> bool:
        return self.momentum is not None or bool(broadcast_topk)

    def record(self) -> dict[str, Any]:
        # as rounds were logged before policies had names: a log read by either reads the same
        return {"policy": self.name, "votes": self.votes, "momentum": None
                if self.momentum is None else {"factor": self.momentum.factor,
                                               "nesterov": self.momentum.nesterov}}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> TokenMean:
        momentum = record.get("momentum")
        return cls(votes=bool(record.get("votes", False)),
                   momentum=None if momentum is None else Momentum(**momentum))

    def describe(self) -> str:
        how = "one sign vote per result" if self.votes else "token-weighted"
        if self.momentum is not None:
            how += (f", outer momentum {self.momentum.factor:g}"
                    + (" (Nesterov)" if self.momentum.nesterov else ""))
        return f"mean ({how})"
