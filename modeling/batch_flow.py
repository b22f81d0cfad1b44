"""What per-example control flow means in a ``@batch`` function: the runtime that
``modeling.batch_decorator`` rewrites ``if``, ``while`` and ``for`` into.

A batch runs every branch and loop iteration that any of its examples takes, on all rows at
once. A ``Block`` records which examples are active in the branch or iteration running now,
and an assignment inside it changes only their rows:

- ``if c:`` runs its body for the examples where ``c`` holds (and the enclosing block is
  active), its ``else`` body for the others; a branch no example takes is skipped.
- ``while c:`` keeps an example active while ``c`` holds for it; once out, it stays out. The
  loop stops when no example is active, so each example runs its own number of iterations.
- ``for item in items:`` over steps of a batch (``x.unbind(1)``) lets an example sit out the
  steps where the item holds none of its data (past its own length).

Inside a block, the rows of inactive examples keep the name's old value and are marked
dormant (mask False), so a value that leaves the block other than by a name (appended to a
list and stacked later) is padding for the examples that did not run it. When the block's body
ends, each name it assigned gets back, in those rows, the mask it had when the body began.

A condition is one value per example (a masked one counts as false) or a plain Python value
or plain tensor, which keeps Python's meaning: that is what a plain tensor at batch size one
gets, so the same function runs unbatched unchanged.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Iterator
from functools import reduce
from numbers import Number
from typing import Any

import torch
from torch import Tensor

from matformer.modeling.batch import MaskedBatch
from matformer.modeling.errors import BatchControlFlowError, BatchShapeError


class _Unbound:
    def __repr__(self) -> str:
        return "UNBOUND"


UNBOUND: Any = _Unbound()  # a name with no value yet when a block assigns it


class Block:
    """One ``if`` branch, ``while`` loop or ``for`` loop of a ``@batch`` function while it runs.

    ``active`` is (B,) bool, or None when no per-example condition encloses the code (then
    every method keeps plain Python behaviour). ``saved`` holds, per name assigned in the
    current branch or iteration, its value when that began.
    """

    def __init__(self, parent: Block | None) -> None:
        self.parent = parent
        self.outer = None if parent is None else parent.active
        self.active: Tensor | None = self.outer
        self.saved: dict[str, Any] = {}
        self.started = False

    def enter(self, condition: Any) -> bool:
        """Start the ``if`` body; False if no example takes it."""
        return self._narrow(self.outer, condition, negate=False)

    def enter_else(self, condition: Any) -> bool:
        """Start the ``else`` body of the ``if`` that tested ``condition``."""
        return self._narrow(self.outer, condition, negate=True)

    def repeat(self, condition: Any) -> bool:
        """Test a ``while`` condition before each iteration."""
        self.saved = {}
        current = self.active if self.started else self.outer
        self.started = True
        return self._narrow(current, condition, negate=False)

    def visit(self, item: Any) -> bool:
        """Start a ``for`` iteration over ``item``; False if no example has data in it."""
        self.saved = {}
        present = _presence(item)
        self.active = self.outer if present is None else _both(self.outer, present)
        return self.active is None or bool(self.active.any())

    def _narrow(self, base: Tensor | None, condition: Any, *, negate: bool) -> bool:
        flags = per_example(condition)
        if isinstance(flags, bool):
            self.active = base
            return flags != negate
        self.active = _both(base, ~flags if negate else flags)
        return bool(self.active.any())

    def assign(self, name: str, old: Any, new: Any) -> Any:
        """The value ``name = new`` leaves: ``new`` in active rows, ``old`` in the others."""
        if self.active is None:
            return new
        block: Block | None = self
        while block is not None:  # enclosing blocks restore this name too
            block.saved.setdefault(name, old)
            block = block.parent
        return _merge(name, old, new, self.active)

    def augment(self, name: str, old: Any, op: str, operand: Any) -> Any:
        """``name op= operand`` (``op`` names a function of ``operator``): Python's in-place
        operator where nothing is per example, else the plain one, since the in-place one
        would also change the rows of inactive examples."""
        if self.active is None:
            return getattr(operator, "i" + op.rstrip("_"))(old, operand)
        return self.assign(name, old, getattr(operator, op)(old, operand))

    def settle(self, name: str, value: Any) -> Any:
        """``name`` at the end of the body: dormant rows get back their masks from its start."""
        if self.active is None:
            return value
        return _restore(value, self.saved[name], self.active)


def per_example(condition: Any) -> Tensor | bool:
    """(B,) bool for a batch condition, a Python bool for anything else."""
    if not isinstance(condition, MaskedBatch):
        return bool(condition)
    size = condition.data.shape[0]
    if condition.data[0].numel() != 1:
        raise BatchControlFlowError(
            "an if/while condition must be one value per example, but each example's has shape "
            f"{tuple(condition.data.shape[1:])}; reduce it first, e.g. (x > 0).all(-1).")
    return condition.data.reshape(size).bool() & condition.mask.reshape(size)


def both(left: Any, right: Callable[[], Any]) -> Any:
    """``left and right()`` in a condition: elementwise when ``left`` is a batch."""
    if isinstance(left, MaskedBatch):
        return _truth(left) & _truth(right())
    return left and right()


def either(left: Any, right: Callable[[], Any]) -> Any:
    """``left or right()`` in a condition: elementwise when ``left`` is a batch."""
    if isinstance(left, MaskedBatch):
        return _truth(left) | _truth(right())
    return left or right()


def negate(value: Any) -> Any:
    """``not value`` in a condition: elementwise for a batch."""
    return ~_truth(value) if isinstance(value, MaskedBatch) else not value


def plain_condition(condition: Any) -> Any:
    """The test of an ``if``/``while`` holding ``return``, ``break``, ``continue`` or
    ``yield``: these jump for every example at once, so the test cannot differ per example."""
    if isinstance(condition, MaskedBatch):
        raise BatchControlFlowError(
            "an if/while whose body holds return, break, continue or yield cannot test a value "
            "that differs per example: assign the result to a name inside the branch and "
            "return it after the block.")
    return condition


def plain_items(items: Iterable[Any]) -> Iterator[Any]:
    """The items of a ``for`` holding ``return``, ``break``, ``continue`` or ``yield``; a step
    that only some examples have would need those jumps per example, so it is refused."""
    for item in items:
        present = _presence(item)
        if present is not None and not bool(present.all()):
            raise BatchControlFlowError(
                "a for loop whose body holds return, break, continue or yield cannot step over "
                "a dynamic dimension (examples have different numbers of steps); keep the "
                "jump out of that loop.")
        yield item


def require_plain(block: Block, statement: str) -> None:
    """Guard a write to an attribute or item, which cannot be limited to active rows."""
    if block.active is not None:
        raise BatchControlFlowError(
            f"`{statement}` writes to an attribute or item inside a per-example if/while/for, "
            "which would change it for the examples that skip the branch too; assign to a "
            "name there and write it after the block.")


def _both(base: Tensor | None, flags: Tensor) -> Tensor:
    return flags if base is None else base & flags


def _truth(value: Any) -> Any:
    if isinstance(value, MaskedBatch):
        return value if value.dtype == torch.bool else value != 0
    return value.bool() if isinstance(value, Tensor) else bool(value)


def _is_group(value: Any) -> bool:
    return isinstance(value, tuple | list) and not isinstance(value, torch.Size)


def _rebuild(group: Any, items: list[Any]) -> Any:
    make = getattr(type(group), "_make", type(group))  # namedtuples build from an iterable
    return make(items)


def _presence(item: Any) -> Tensor | None:
    """(B,) which examples hold real data in ``item``; None if it holds no batch."""
    if _is_group(item):
        found = [p for p in map(_presence, item) if p is not None]
        return reduce(operator.and_, found) if found else None
    if isinstance(item, MaskedBatch):
        return item.mask.reshape(item.mask.shape[0], -1).any(dim=1)
    return None


def _is_value(value: Any) -> bool:
    return isinstance(value, MaskedBatch | Tensor | Number)


def _parts(name: str, value: Any, size: int, device: torch.device
           ) -> tuple[Tensor, Tensor | None, tuple[bool, ...] | None]:
    """Data, mask and dims of ``value``; a plain value has no mask (real everywhere)."""
    if isinstance(value, MaskedBatch):
        return value.data, value.mask, value.dims
    data = torch.as_tensor(value, device=device)
    if data.dim() == 0:
        return data.reshape(1), None, None
    if data.shape[0] not in (1, size):
        raise BatchShapeError(
            f"`{name}` is given a plain tensor of shape {tuple(data.shape)} inside a "
            f"per-example block; it needs one row per example ({size}) or one shared row.")
    return data, None, None


def _merge(name: str, old: Any, new: Any, active: Tensor) -> Any:
    if _is_group(new):
        if old is UNBOUND:
            old = [UNBOUND] * len(new)
        if not _is_group(old) or len(old) != len(new):
            raise BatchControlFlowError(f"`{name}` changes from {type(old).__name__} to a "
                                        f"{len(new)}-tuple inside a per-example block.")
        return _rebuild(new, [_merge(name, o, n, active) for o, n in zip(old, new, strict=True)])
    if not _is_value(new) or not (old is UNBOUND or _is_value(old)):
        if new is old:
            return new
        raise BatchControlFlowError(
            f"`{name}` is given a {type(new).__name__} inside a per-example if/while/for; only "
            "tensors, MaskedBatches, numbers and tuples of them can differ per example. Assign "
            "it outside the block.")
    size = active.shape[0]
    new_parts = _parts(name, new, size, active.device)
    old_parts = new_parts if old is UNBOUND else _parts(name, old, size, active.device)
    rank = max(new_parts[0].dim(), old_parts[0].dim())
    if any(mask is not None and mask.dim() != rank for _, mask, _ in (new_parts, old_parts)):
        raise BatchShapeError(f"`{name}` changes its number of dimensions inside a "
                              "per-example block; give both values the same rank.")
    keep = active.reshape(-1, *[1] * (rank - 1))  # (B, 1, ...)
    data = torch.where(keep, new_parts[0], old_parts[0])
    real = torch.ones((1,) * rank, dtype=torch.bool, device=data.device)
    mask = (real if new_parts[1] is None else new_parts[1]) & keep  # dormant where inactive
    flags = [dims for _, _, dims in (new_parts, old_parts) if dims is not None]
    dims = tuple(any(f) for f in zip(*flags, strict=True)) if flags else (False,) * (rank - 1)
    return MaskedBatch(data, mask, dims)


def _restore(value: Any, saved: Any, active: Tensor) -> Any:
    if _is_group(value) and _is_group(saved) and len(value) == len(saved):
        return _rebuild(value, [_restore(v, s, active) for v, s in zip(value, saved, strict=True)])
    if not isinstance(value, MaskedBatch) or saved is UNBOUND or not _is_value(saved):
        return value
    rank = value.data.dim()
    if isinstance(saved, MaskedBatch):
        before, dims = saved.mask, tuple(a or b for a, b in zip(value.dims, saved.dims,
                                                                 strict=True))
    else:
        before = torch.ones((1,) * rank, dtype=torch.bool, device=value.data.device)
        dims = value.dims
    keep = active.reshape(-1, *[1] * (rank - 1))
    return MaskedBatch(value.data, torch.where(keep, value.mask, before), dims)
