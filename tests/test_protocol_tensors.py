"""Tensor ↔ message: exact round trips for every dtype and layout, and every decode error."""

from __future__ import annotations

import grpc
import pytest
import torch

from matformer.protocol.errors import ProtocolError, TensorSizeMismatch, UnknownDtype
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.tensors import DTYPES, decode_tensor, encode_tensor


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape) * 100).to(dtype)
    info = torch.iinfo(dtype)
    low, high = max(info.min, -1000), min(info.max, 1000)
    return torch.randint(low, high, shape, dtype=torch.int64).to(dtype)


def _round_trip(tensor: torch.Tensor) -> torch.Tensor:
    return decode_tensor(pb.Tensor.FromString(encode_tensor(tensor).SerializeToString()))


@pytest.mark.parametrize("name", list(DTYPES))
@pytest.mark.parametrize("shape", [(3, 5), (), (0,), (2, 0, 4), (1, 1, 7)])
def test_round_trip_is_exact(name: str, shape: tuple[int, ...]) -> None:
    tensor = _sample(DTYPES[name], shape)
    message = encode_tensor(tensor)
    assert message.dtype == name and tuple(message.shape) == shape
    decoded = _round_trip(tensor)
    assert decoded.dtype == tensor.dtype and decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)


@pytest.mark.parametrize("name", list(DTYPES))
def test_non_contiguous_input_travels_in_row_major_order(name: str) -> None:
    base = _sample(DTYPES[name], (6, 8))
    for view in (base.t(), base[:, ::3], base[1:5, 2:].unsqueeze(0).expand(2, 4, 6)):
        assert not view.is_contiguous()
        assert torch.equal(_round_trip(view), view.contiguous())


def test_bytes_are_little_endian() -> None:
    assert encode_tensor(torch.tensor([1], dtype=torch.int32)).data == b"\x01\x00\x00\x00"
    assert encode_tensor(torch.tensor(1.0, dtype=torch.bfloat16)).data == b"\x80\x3f"
    assert encode_tensor(torch.tensor([True, False])).data == b"\x01\x00"


def test_decoded_tensor_owns_writable_memory() -> None:
    message = encode_tensor(torch.arange(4, dtype=torch.float32))
    decoded = decode_tensor(message)
    decoded += 1  # frombuffer over the message's bytes would be read-only
    assert decode_tensor(message).tolist() == [0.0, 1.0, 2.0, 3.0]


@pytest.mark.parametrize("dtype", [torch.complex128, torch.complex64, torch.uint32])
def test_encoding_a_dtype_the_wire_does_not_carry_names_the_choices(dtype: torch.dtype) -> None:
    with pytest.raises(UnknownDtype, match="bfloat16"):
        encode_tensor(torch.zeros(2, dtype=dtype))


@pytest.mark.parametrize(
    ("message", "error", "match"),
    [
        (pb.Tensor(dtype="complex64", shape=[1], data=bytes(8)), UnknownDtype, "'complex64'"),
        (pb.Tensor(shape=[1], data=bytes(4)), UnknownDtype, "dtype ''"),
        (pb.Tensor(dtype="float32", shape=[2, 3], data=bytes(23)), TensorSizeMismatch, "needs 24"),
        (pb.Tensor(dtype="float32", shape=[2, 3], data=bytes(28)), TensorSizeMismatch, "has 28"),
        (pb.Tensor(dtype="int64", shape=[], data=b""), TensorSizeMismatch, "needs 8"),
        (pb.Tensor(dtype="uint8", shape=[0], data=b"x"), TensorSizeMismatch, "needs 0"),
        (pb.Tensor(dtype="uint8", shape=[-2, -3], data=bytes(6)), ProtocolError, "negative"),
        (pb.Tensor(dtype="bool", shape=[2], data=b"\x01\x02"), ProtocolError, "0 and 1"),
    ],
)
def test_decode_trusts_nothing(message: pb.Tensor, error: type, match: str) -> None:
    with pytest.raises(error, match=match) as caught:
        decode_tensor(message, "gradient")
    assert "gradient" in str(caught.value)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
