"""The coordinator's half of the update rule (docs/architecture.md, "The update record"): each
parameter's results become its aggregate, the aggregate the step every replica applies, and
the master moves by that step.

The rule's ``broadcast`` decides the step's form: None gives the exact aggregate
(``DenseStep``, its signs alone under ``sign``); a ``Broadcast`` gives top-k DCT levels and a
residual, what they left out, that is added to the next round's aggregate. With ``[update]
momentum`` the aggregate first goes through the outer momentum (``Momentum``), as DiLoCo's
outer Nesterov SGD does with pseudo-gradients. Replicas never
compute a step, they only apply one (``UpdateRule.apply``, in ``modeling``), so this half
lives with the coordinator.

    rule = UpdateConfig(rule="sign", lr=1e-3, broadcast_topk=48).build()
    master, steps, carried = close_round(rule, master, results_by_name, carried)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from matformer.modeling.compression import (
    Broadcast,
    ChunkGrid,
    Region,
    SparseResult,
    Step,
    UpdateRule,
    bounding_box,
    dense_step,
    full_region,
    get_encoding,
    region_slices,
)
from matformer.modeling.compression.encodings import ChunkTopK
from matformer.server.aggregation import Aggregate, aggregate, coefficient_mean

# The arithmetic of a compressed close, logged with each round's inputs (``"arithmetic"`` in
# their record): a resume closes a logged round again only with the arithmetic that closed
# it. 2: the momentum kept in coefficients, the residual fed back from the kept levels
# (``Broadcast.encode_coefficients``); a round logged without it was closed by 1.
ARITHMETIC = 2


def update_step(rule: UpdateRule, aggregate: Aggregate, covered: Sequence[Region],
                residual: Tensor | None = None) -> tuple[Step, Tensor | None]:
    """The step that carries ``aggregate`` (over the union of ``covered``, the regions of the
    results behind it) to every replica, and the broadcast's new residual (None for an exact
    step, which leaves nothing out); the residual in and out as universal-shaped values."""
    broadcast = rule.broadcast
    if broadcast is None:
        step, _, _ = broadcast_step(rule, aggregate, covered, None)
        return step, residual
    kept = None if residual is None else broadcast.residual_of(residual)
    step, left, _ = broadcast_step(rule, aggregate, covered, kept)
    return step, broadcast.values_of(left, step.shape)


def broadcast_step(rule: UpdateRule, aggregate: Aggregate, covered: Sequence[Region],
                   residual: Tensor | None) -> tuple[Step, Tensor | None, Tensor | None]:
    """``update_step`` with the residual as the broadcast keeps it (``Carried``), and a
    compressed step's direction over its box (None for exact), which ``rule.apply`` takes
    as ``direction``."""
    if rule.broadcast is None:
        step = dense_step(aggregate.values, covered, signs=rule.name == "sign")
        return step, residual, None
    return rule.broadcast.encode(aggregate.values, covered, residual)


@dataclass(frozen=True, slots=True)
class Momentum:
    """The outer step's momentum, as ``torch.optim.SGD`` keeps it (dampening 0): per element
    ``buf ← μ·buf + agg``, and the direction is ``buf``, or ``agg + μ·buf`` with Nesterov
    (DiLoCo's outer optimizer: μ = 0.9, Nesterov). Only covered elements take part: an
    element no result covered keeps its buffer and does not move. Both are linear, so the
    buffer may live in the broadcast's DCT coefficients as well as in values."""

    factor: float  # μ
    nesterov: bool = False

    def direction(self, values: Tensor, covered: Tensor | None, buffer: Tensor | None
                  ) -> tuple[Tensor, Tensor]:
        """(direction, new buffer) for an aggregate's ``values`` where ``covered`` (a bool
        that broadcasts against them; None: everywhere). Neither output shares memory with
        an input, and ``buffer`` is not changed."""
        previous = torch.zeros_like(values, dtype=torch.float32) if buffer is None else buffer
        moved = torch.mul(previous, self.factor).add_(values)  # SGD's μ·buf + agg
        buffer = moved if covered is None else torch.where(covered, moved, previous)
        direction = torch.mul(buffer, self.factor).add_(values) if self.nesterov \
            else buffer.clone()
        return (direction if covered is None else torch.where(covered, direction, 0.0)), buffer


@dataclass(slots=True)
class Carried:
    """What the coordinator carries from one round's steps to the next, per canonical name
    (float32): the broadcast's residual (what it left out, as the chunkwise DCT of its
    values over whole chunks: ``Broadcast.residual_of``) and the outer momentum buffer (laid
    out as the residual is under a compressed broadcast, so that a close never leaves the
    coefficients; universal-shaped values under an exact one). Replicas apply only steps and
    never need either; the coordinator saves both with each checkpoint and rebuilds them on
    resume (``server/outer_state.py``)."""

    residual: dict[str, Tensor] = field(default_factory=dict)
    momentum: dict[str, Tensor] = field(default_factory=dict)
    # a round policy's own per-parameter state, by kind (server/policies/), e.g. outer
    # AdamW's exp_avg and exp_avg_sq: kind → name → float32, universal shape
    buffers: dict[str, dict[str, Tensor]] = field(default_factory=dict)


def close_round(rule: UpdateRule, master: Mapping[str, Tensor],
                by_name: Mapping[str, Sequence[SparseResult]], carried: Carried | None = None,
                *, votes: bool = False, momentum: Momentum | None = None
                ) -> tuple[dict[str, Tensor], dict[str, Step], Carried]:
    """A round: each canonical name's results (validated, aggregated; ``votes``: by majority
    vote; through ``momentum`` when given) become its step, applied to ``master``. Returns the
    new master (names without results unchanged), the steps, and what is carried to the next
    round. Inputs are not changed.

    A compressed broadcast of DCT results whose regions lie on the chunk grid (the usual
    case) never leaves the coefficients: the results are summed where they were sent, the
    momentum and the residual are added there, the broadcast keeps each chunk's largest,
    and the only pass back to values is the step's exact decode, block by block as it moves
    the master (``UpdateRule.apply``)."""
    master = dict(master)
    carried = carried or Carried()
    residual, buffers = dict(carried.residual), dict(carried.momentum)
    steps = {}
    for name, results in by_name.items():
        covered = [r.region for r in results]
        broadcast = rule.broadcast
        if broadcast is not None and not votes and _summable(results, broadcast, covered):
            shape = results[0].shape
            pending = coefficient_mean(results)
            if momentum is not None:
                pending, buffers[name] = _through_momentum(
                    momentum, broadcast, pending, shape, covered, buffers.get(name))
            step, residual[name] = broadcast.encode_coefficients(
                pending, shape, covered, residual.get(name))
            master[name] = rule.apply(master[name], step)
        else:
            mean = aggregate(results, votes=votes)
            if momentum is not None:
                buffer = buffers.get(name)
                if broadcast is not None and buffer is not None:  # kept in coefficients
                    buffer = broadcast.values_of(buffer, mean.values.shape)
                values, buffer = momentum.direction(mean.values, mean.covered, buffer)
                buffers[name] = buffer if broadcast is None else broadcast.residual_of(buffer)
                mean = Aggregate(values=values, tokens=mean.tokens)
            step, left, decoded = broadcast_step(rule, mean, covered, residual.get(name))
            if left is not None:
                residual[name] = left
            master[name] = rule.apply(master[name], step, direction=decoded)
        steps[name] = step
    return master, steps, Carried(residual=residual, momentum=buffers,
                                  buffers=dict(carried.buffers))


def _through_momentum(momentum: Momentum, broadcast: Broadcast, summed: Tensor,
                      shape: Sequence[int], covered: Sequence[Region], buffer: Tensor | None
                      ) -> tuple[Tensor, Tensor]:
    """``Momentum.direction`` in the broadcast's coefficients: ``summed`` over the box of
    ``covered`` (on the grid), ``buffer`` over every chunk of ``shape``. Returns the
    direction over the box and the new buffer; chunks no result covered keep theirs."""
    grid = ChunkGrid.of(shape, broadcast.chunk)
    box = bounding_box(covered)
    spread, whole = Broadcast.spread(grid, box, covered, summed.device)
    where = region_slices(box)
    chunks = [n for pair in zip(grid.region_counts(box), grid.chunk, strict=True) for n in pair]
    old = None if buffer is None else buffer[where]
    if whole:
        direction, new = momentum.direction(summed, None, old)
    else:
        direction, new = momentum.direction(
            summed.view(chunks), spread, None if old is None else old.reshape(chunks))
        direction, new = direction.view(summed.shape), new.view(summed.shape)
    if box == full_region(grid.shape):
        return direction, new
    out = torch.zeros(grid.padded(full_region(grid.shape))) if buffer is None \
        else buffer.clone()
    out[where] = new
    return direction, out


def _summable(results: Sequence[SparseResult], broadcast: Broadcast,
              covered: Sequence[Region]) -> bool:
    """Whether the broadcast can take these results' coefficient sum as it is: chunked
    results on the broadcast's own grid, every region on it."""
    grid = ChunkGrid.of(results[0].shape, broadcast.chunk)
    return all(r.chunk == grid.chunk and isinstance(get_encoding(r.encoding), ChunkTopK)
               for r in results) and broadcast.on_grid(grid.shape, covered)
