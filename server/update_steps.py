"""The coordinator's half of the update rule (docs/architecture.md, "The update record"): each
parameter's results become its aggregate, the aggregate the step every replica applies, and
the master moves by that step.

The rule's ``broadcast`` decides the step's form: None gives the exact aggregate
(``DenseStep``, its signs alone under ``sign``); a ``Broadcast`` gives top-k DCT levels and a
residual, what they left out, that is added to the next round's aggregate. Replicas never
compute a step, they only apply one (``UpdateRule.apply``, in ``modeling``), so this half
lives with the coordinator.

    rule = UpdateConfig(rule="sign", lr=1e-3, broadcast_topk=48).build()
    master, steps, residual = close_round(rule, master, results_by_name, residual)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from modeling.compression import Region, SparseResult, Step, UpdateRule, dense_step, region_slices
from server.aggregation import Aggregate, aggregate


def update_step(rule: UpdateRule, aggregate: Aggregate, covered: Sequence[Region],
                residual: Tensor | None = None) -> tuple[Step, Tensor | None]:
    """The step that carries ``aggregate`` (over the union of ``covered``, the regions of the
    results behind it) to every replica, and the broadcast's new residual (None for an exact
    step, which leaves nothing out)."""
    step, residual, _ = _step(rule, aggregate, covered, residual)
    return step, residual


def _step(rule: UpdateRule, aggregate: Aggregate, covered: Sequence[Region],
          residual: Tensor | None) -> tuple[Step, Tensor | None, Tensor | None]:
    """``update_step``, and a compressed step's direction over its box (None for exact)."""
    if rule.broadcast is None:
        step = dense_step(aggregate.values, covered, signs=rule.name == "sign")
        return step, residual, None
    return rule.broadcast.encode(aggregate.values, covered, residual)


def close_round(rule: UpdateRule, master: Mapping[str, Tensor],
                by_name: Mapping[str, Sequence[SparseResult]],
                residual: Mapping[str, Tensor] | None = None, *, votes: bool = False
                ) -> tuple[dict[str, Tensor], dict[str, Step], dict[str, Tensor]]:
    """A round: each canonical name's results (validated, aggregated; ``votes``: by majority
    vote) become its step, applied to ``master``. Returns the new master (names without
    results unchanged), the steps, and the broadcast's residual after them. Inputs are not
    changed."""
    master, residual = dict(master), dict(residual or {})
    steps = {}
    for name, results in by_name.items():
        step, left, decoded = _step(rule, aggregate(results, votes=votes),
                                    [r.region for r in results], residual.get(name))
        if left is not None:
            residual[name] = left
        direction = None
        if decoded is not None:  # spare decoding it again over the whole tensor
            direction = torch.zeros(step.shape, device=decoded.device)
            direction[region_slices(step.box)] = decoded
        master[name] = rule.apply(master[name], step, direction=direction)
        steps[name] = step
    return master, steps, residual
