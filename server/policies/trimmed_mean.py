"""``trimmed_mean``: element by element, the mean of the members' results after the largest
and smallest ``trim`` fraction of them are set aside (Yin et al., 2018, "Byzantine-robust
distributed learning"): a member whose values are a thousand times its peers' moves no
element further than an honest extreme would. Each result counts once, whatever its tokens;
each element is trimmed among the results covering it (a tier-2 member covers fewer
elements). Every result is decoded to its dense values first, so a close holds one float32
copy of a parameter per result; a relay's sum hides the results to trim, so a relay cannot
serve such a run."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from matformer.modeling.compression import Step, UpdateRule, decode, region_slices
from matformer.modeling.compression.validation import validate_group
from matformer.modeling.settings import setting
from matformer.server.aggregation import Aggregate, covering_tokens
from matformer.server.policies.base import Results, RoundPolicy
from matformer.server.sections.checks import require
from matformer.server.update_steps import Carried, broadcast_step


@dataclass(kw_only=True, slots=True, frozen=True)
class TrimOptions:
    trim: float = setting(0.34, low=0, high=0.5, help=(
        "the fraction of the results covering an element set aside at each end, rounded "
        "down, below 0.5 (0.34: of three, the largest and the smallest, leaving the median)"))

    def __post_init__(self) -> None:
        require(self.trim < 0.5, f"[policy.options] trim must lie in [0, 0.5), got "
                f"{self.trim}: at 0.5 every result would be set aside.")


def trimmed_mean(stacked: Tensor, count: Tensor, trim: float) -> Tensor:
    """Along dim 0 of ``stacked`` (NaN where a result does not cover the element), the
    mean of the values left once ``floor(trim · count)`` are set aside at each end."""
    ordered, _ = torch.sort(stacked, dim=0)  # NaN last: the covering values come first
    cut = torch.floor(count * trim)
    rank = torch.arange(stacked.shape[0], device=stacked.device).view(
        -1, *([1] * (stacked.dim() - 1)))
    kept = (rank >= cut) & (rank < count - cut)
    total = torch.where(kept, ordered, 0.0).sum(dim=0)
    return torch.where(count > 0, total / (count - 2 * cut).clamp(min=1), 0.0)


class TrimmedMean(RoundPolicy):
    name = "trimmed_mean"
    Options = TrimOptions
    takes_partials = False

    def close(self, rule: UpdateRule, master: Mapping[str, Tensor], by_name: Results,
              carried: Carried | None = None
              ) -> tuple[dict[str, Tensor], dict[str, Step], Carried]:
        master, carried = dict(master), carried or Carried()
        residual, steps = dict(carried.residual), {}
        for name, results in by_name.items():
            validate_group(results)
            stacked = torch.full((len(results), *results[0].shape), math.nan)
            for row, result in zip(stacked, results, strict=True):
                row[region_slices(result.region)] = decode(result).float()
            count = (~stacked.isnan()).sum(dim=0).float()
            mean = Aggregate(values=trimmed_mean(stacked, count, self.options.trim),
                             tokens=covering_tokens(results))
            step, left, decoded = broadcast_step(rule, mean, [r.region for r in results],
                                                 residual.get(name))
            if left is not None:
                residual[name] = left
            master[name] = rule.apply(master[name], step, direction=decoded)
            steps[name] = step
        return master, steps, Carried(residual=residual, momentum=dict(carried.momentum),
                                      buffers=dict(carried.buffers))
