"""Tensors on the wire: a ``Tensor`` message holds a dtype name, a shape and the raw
row-major little-endian bytes. Decoding trusts nothing: dtype, shape and byte count are
checked before any memory is interpreted."""

from __future__ import annotations

import math
import sys

import torch

from matformer.protocol.errors import ProtocolError, TensorSizeMismatch, UnknownDtype
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint16": torch.uint16, "uint8": torch.uint8, "bool": torch.bool,
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
_ITEMSIZE = {name: dtype.itemsize for name, dtype in DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """The name ``dtype`` travels under; UnknownDtype for one the protocol does not carry."""
    name = _NAMES.get(dtype)
    if name is None:
        raise UnknownDtype(
            f"dtype {dtype} cannot travel; convert to one of {', '.join(DTYPES)} first."
        )
    return name


def encode_tensor(tensor: torch.Tensor) -> pb.Tensor:
    """Any-device, any-layout tensor → message (the bytes are a copy in row-major order)."""
    name = dtype_name(tensor.dtype)
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)  # (numel,), also for 0-d
    raw = _little_endian(flat.view(torch.uint8), tensor.element_size())  # (numel * itemsize,)
    return pb.Tensor(dtype=name, shape=tensor.shape, data=raw.numpy().tobytes())


def decode_tensor(message: pb.Tensor, what: str = "tensor") -> torch.Tensor:
    """Message → a new CPU tensor that owns its memory; ``what`` names it in errors."""
    dtype = DTYPES.get(message.dtype)
    if dtype is None:
        raise UnknownDtype(
            f"{what} has dtype {message.dtype!r}; the protocol carries {', '.join(DTYPES)}."
        )
    shape = tuple(message.shape)
    if any(dim < 0 for dim in shape):
        raise ProtocolError(f"{what} has a negative dimension in its shape {list(shape)}.")
    itemsize = _ITEMSIZE[message.dtype]
    expected = math.prod(shape) * itemsize
    if len(message.data) != expected:
        raise TensorSizeMismatch(
            f"{what} of dtype {message.dtype} and shape {list(shape)} needs {expected} bytes "
            f"but has {len(message.data)}; the sender encoded it wrongly."
        )
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(bytearray(message.data), dtype=torch.uint8)  # owns a copy
    if dtype == torch.bool and bool((raw > 1).any()):
        raise ProtocolError(f"{what} is bool but holds bytes other than 0 and 1.")
    return _little_endian(raw, itemsize).view(dtype).reshape(shape)


def _little_endian(raw: torch.Tensor, itemsize: int) -> torch.Tensor:
    """Native ↔ little-endian byte order of a flat uint8 view (a no-op on little-endian hosts)."""
    if sys.byteorder == "little" or itemsize == 1:
        return raw
    return raw.view(-1, itemsize).flip(-1).reshape(-1)
