"""Elementwise ops: each output position depends only on the same position of the inputs.

The op runs on the padded data as it is: padding may turn into anything, which is harmless
because it stays masked. Next to a tensor that needs a gradient (a parameter), whose gradient
sums over rows, the batch's padding is read as 0 instead (``table.real_data``).

Several batch operands must have the same rank and batch size; their masks combine with AND,
so a position is real only where it is real in every operand, and a dimension is dynamic where
any operand's is. A plain tensor or number is the same for every example and broadcasts as
torch broadcasts it; it may not have more dimensions than the batch, which would push the
batch dimension away from dimension 0.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import reduce
from operator import and_
from typing import Any

from torch import Tensor

from matformer.modeling.batch import MaskedBatch
from matformer.modeling.batch_ops.table import (
    batches,
    implements,
    named,
    op_name,
    real_data,
    unwrap,
)
from matformer.modeling.errors import BatchShapeError

UNARY = (
    "abs", "neg", "negative", "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sqrt",
    "rsqrt", "square", "sin", "cos", "tan", "tanh", "sigmoid", "relu", "relu6", "gelu", "silu",
    "mish", "softplus", "elu", "selu", "celu", "leaky_relu", "hardtanh", "logsigmoid",
    "softsign", "erf", "floor", "ceil", "round", "trunc", "sign", "reciprocal", "clamp", "clip",
    "logical_not", "bitwise_not", "isnan", "isinf", "isfinite", "nan_to_num", "dropout",
    "float", "double", "half", "bfloat16", "long", "int", "bool", "contiguous", "clone",
    "detach", "zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like",
    "__neg__", "__abs__", "__invert__",
)
BINARY = (
    "add", "sub", "subtract", "rsub", "mul", "multiply", "div", "divide", "true_divide",
    "floor_divide", "remainder", "fmod", "pow", "float_power", "atan2", "hypot", "maximum",
    "minimum", "fmax", "fmin", "eq", "ne", "lt", "le", "gt", "ge", "logical_and",
    "logical_or", "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "where",
    "masked_fill", "lerp",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__",
    "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__",
    "__rpow__", "__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__", "__eq__",
    "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
)


@implements(*named(*UNARY, *BINARY))
def elementwise(func: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> MaskedBatch:
    operands = (*args, *kwargs.values())
    inputs = batches(operands)
    rank, size = inputs[0].data.dim(), inputs[0].data.shape[0]
    for other in inputs[1:]:
        if other.data.dim() != rank or other.data.shape[0] != size:
            raise BatchShapeError(
                f"{op_name(func)}: batches of shape {tuple(inputs[0].data.shape)} and "
                f"{tuple(other.data.shape)} do not line up example by example; give them the "
                "same batch size and number of dimensions (unsqueeze one first).")
    for operand in operands:
        if isinstance(operand, Tensor) and operand.dim() > rank:
            raise BatchShapeError(
                f"{op_name(func)}: a plain tensor of shape {tuple(operand.shape)} has more "
                f"dimensions than the batch ({rank}, counting the batch dimension); it would "
                "move the batch dimension. Write it at batch size one, e.g. (1, ...).")
    if any(isinstance(operand, Tensor) and operand.requires_grad for operand in operands):
        args, kwargs = _real(args), _real(kwargs)
    data = func(*unwrap(args), **unwrap(kwargs))
    if not isinstance(data, Tensor) or data.dim() != rank or data.shape[0] != size:
        raise BatchShapeError(f"{op_name(func)} did not keep one row per example on a "
                              "MaskedBatch; call it on batch.data and rebuild the batch.")
    mask = reduce(and_, (batch.mask for batch in inputs))
    dims = tuple(any(flags) for flags in zip(*(batch.dims for batch in inputs), strict=True))
    return MaskedBatch(data, mask, dims)


def _real(values: Any) -> Any:
    """``values`` (a tuple or dict) with each batch's padding set to 0."""
    def clean(value: Any) -> Any:
        if isinstance(value, MaskedBatch):
            return MaskedBatch(real_data(value), value.mask, value.dims)
        return value
    if isinstance(values, dict):
        return {key: clean(value) for key, value in values.items()}
    return tuple(clean(value) for value in values)
