"""Errors of the wire protocol. Each carries the gRPC status code a coordinator answers with,
so a handler can turn any of them into a reply with ``context.abort(err.code, str(err))``."""

from __future__ import annotations

import grpc

from matformer.modeling.errors import MatformerError


class ProtocolError(MatformerError, ValueError):
    """A message is malformed: the sender broke the protocol. Never retried as is."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class UnknownDtype(ProtocolError):
    """A Tensor message names a dtype the protocol does not carry."""


class TensorSizeMismatch(ProtocolError):
    """A Tensor message's byte count disagrees with its dtype and shape."""


class MalformedSparseResult(ProtocolError):
    """A SparseResult message is inconsistent (region, chunk ids, indices, values, tokens)."""


class LayoutMismatch(MalformedSparseResult):
    """A SparseResult message names a parameter, shape, count or dtype the run does not take
    from its sender: refused before any of its tensors is decoded, so what a message declares
    never decides how much memory decoding it takes."""


class MalformedStream(ProtocolError):
    """A stream's messages arrive out of order: no header, a second header, a gap, a short end."""


class UnsafePath(ProtocolError):
    """A requested file path is absolute or leaves the directory it must stay in."""


class ChecksumMismatch(ProtocolError):
    """A received file's sha256 is not the one announced; nothing was kept."""

    code = grpc.StatusCode.DATA_LOSS
