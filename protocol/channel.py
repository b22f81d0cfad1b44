"""What both ends of a coordinator connection must agree on beyond the ``.proto``.

Streams carry one parameter per message, so a message can exceed gRPC's 4 MiB default
(a dense result of a large embedding, say); both ends raise the limit to
``MAX_MESSAGE_BYTES``: ``grpc.server(executor, options=GRPC_OPTIONS)`` and
``grpc.insecure_channel(target, options=GRPC_OPTIONS)`` (or ``secure_channel``).
"""

from __future__ import annotations

from protocol.matformer.v1 import coordinator_pb2 as pb

COORDINATOR_SERVICE: str = pb.DESCRIPTOR.services_by_name["Coordinator"].full_name
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
GRPC_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
)
