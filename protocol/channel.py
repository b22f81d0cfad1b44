"""What both ends of a coordinator connection must agree on beyond the ``.proto``.

Streams carry one parameter per message, so a message can exceed gRPC's 4 MiB default
(a dense result of a large embedding, say); both ends raise the limit to
``MAX_MESSAGE_BYTES``: ``grpc.server(executor, options=GRPC_OPTIONS)`` and
``grpc.insecure_channel(target, options=GRPC_OPTIONS)`` (or ``secure_channel``).
"""

from __future__ import annotations

from matformer.protocol.matformer.v1 import coordinator_pb2 as pb

COORDINATOR_SERVICE: str = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
GRPC_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)
# A client's channel tries to reconnect at least this often. gRPC's own backoff grows to 120 s,
# so a coordinator back after a minute's outage went unanswered for 12 s more, and after a
# longer one for up to two minutes; the client retries calls with its own backoff anyway.
RECONNECT_MAX_MS = 2000
CLIENT_OPTIONS = (*GRPC_OPTIONS, ("grpc.max_reconnect_backoff_ms", RECONNECT_MAX_MS))
