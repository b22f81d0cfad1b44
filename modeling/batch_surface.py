"""The Tensor-like face of a MaskedBatch: what code written for one example may call on it.

Sizes that every example shares (``dim()``, static sizes, ``dtype``, ``device``) answer at
once; torch functions (through ``__torch_function__``), Tensor methods (through
``__getattr__``) and operators all run through the op table in ``modeling.batch_ops``; what
differs per example is refused: the size of a dynamic dimension, and a truth value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from matformer.modeling.errors import BatchControlFlowError, DynamicDimError


def _dispatch(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    from matformer.modeling.batch_ops import dispatch  # the op table imports MaskedBatch

    return dispatch(func, args, kwargs)


def _operator(func: Callable[..., Any]) -> Callable[..., Any]:
    """An operator method (``+``, ``@``, ``>``...) that runs the Tensor one through the op
    table."""
    def method(self: TensorSurface, *args: Any) -> Any:
        return _dispatch(func, (self, *args), {})
    method.__name__ = func.__name__
    return method


class TensorSurface:
    """Mixed into MaskedBatch, whose ``data`` (B, ...) and ``dims`` it reads."""

    __slots__ = ()
    data: Tensor
    dims: tuple[bool, ...]

    def dim(self) -> int:
        return self.data.dim()

    @property
    def ndim(self) -> int:
        return self.data.dim()

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    @property
    def device(self) -> torch.device:
        return self.data.device

    def size(self, dim: int | None = None) -> torch.Size | int:
        """Sizes shared by every example: the batch size and static dimensions. A dynamic
        dimension's size differs per example and is refused; ``maxsize`` gives its padded
        size."""
        dynamic = [d + 1 for d, flag in enumerate(self.dims) if flag]
        if dim is None and not dynamic:
            return self.data.size()
        if dim is not None and (dim % self.data.dim()) not in dynamic:
            return self.data.size(dim)
        raise DynamicDimError(
            f"dimension {dim if dim is not None else dynamic[0]} of this MaskedBatch is dynamic: "
            "its size differs per example. Use maxsize() for the padded size, or the mask for "
            "each example's own.")

    @property
    def shape(self) -> torch.Size:
        return self.size()

    def maxsize(self, dim: int | None = None) -> torch.Size | int:
        """The padded sizes (the largest example's in dynamic dimensions)."""
        return self.data.size() if dim is None else self.data.size(dim)

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        return _dispatch(func, args, kwargs or {})

    def __getattr__(self, name: str) -> Any:
        """Tensor methods (``x.mean(-1)``, ``x.unbind(1)``...) run through the op table, which
        refuses the ones it does not implement when they are called."""
        method = getattr(Tensor, name, None)
        if name.startswith("_") or not callable(method):
            raise AttributeError(f"MaskedBatch has no attribute {name!r}; read batch.data "
                                 "and batch.mask for the padded tensors.")

        def bound(*args: Any, **kwargs: Any) -> Any:
            return _dispatch(method, (self, *args), kwargs)
        return bound

    def __bool__(self) -> bool:
        raise BatchControlFlowError(
            "a MaskedBatch has one truth value per example, so Python's if/while/and/or cannot "
            "branch on it. Decorate the function with @batch (matformer.modeling.batch_decorator) "
            "so each example takes its own branch, or use torch.where.")

    def __getitem__(self, index: Any) -> Any:
        return _dispatch(Tensor.__getitem__, (self, index), {})

    __hash__ = object.__hash__  # identity, as for tensors: == is elementwise below
    # a batch is never a Tensor, so Python calls these operators, not torch's
    __add__, __radd__ = _operator(Tensor.__add__), _operator(Tensor.__radd__)
    __sub__, __rsub__ = _operator(Tensor.__sub__), _operator(Tensor.__rsub__)
    __mul__, __rmul__ = _operator(Tensor.__mul__), _operator(Tensor.__rmul__)
    __truediv__, __rtruediv__ = _operator(Tensor.__truediv__), _operator(Tensor.__rtruediv__)
    __floordiv__ = _operator(Tensor.__floordiv__)
    __rfloordiv__ = _operator(Tensor.__rfloordiv__)
    __mod__, __rmod__ = _operator(Tensor.__mod__), _operator(Tensor.__rmod__)
    __pow__, __rpow__ = _operator(Tensor.__pow__), _operator(Tensor.__rpow__)
    __matmul__, __rmatmul__ = _operator(Tensor.__matmul__), _operator(Tensor.__rmatmul__)
    __and__, __rand__ = _operator(Tensor.__and__), _operator(Tensor.__rand__)
    __or__, __ror__ = _operator(Tensor.__or__), _operator(Tensor.__ror__)
    __xor__, __rxor__ = _operator(Tensor.__xor__), _operator(Tensor.__rxor__)
    __neg__, __abs__ = _operator(Tensor.__neg__), _operator(Tensor.__abs__)
    __invert__ = _operator(Tensor.__invert__)
    __eq__, __ne__ = _operator(Tensor.__eq__), _operator(Tensor.__ne__)  # type: ignore[assignment]
    __lt__, __le__ = _operator(Tensor.__lt__), _operator(Tensor.__le__)
    __gt__, __ge__ = _operator(Tensor.__gt__), _operator(Tensor.__ge__)
