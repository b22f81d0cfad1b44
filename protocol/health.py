"""The standard gRPC health service (``grpc.health.v1``), so load balancers, probes and
``local-testnet`` can ask whether the coordinator is up without a session."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from matformer.protocol.channel import COORDINATOR_SERVICE


def add_health(server: grpc.Server) -> health.HealthServicer:
    """Register the health service on ``server``, reporting SERVING for the whole server
    ("") and for the Coordinator; the caller may later ``set(name, NOT_SERVING)``."""
    servicer = health.HealthServicer()
    for name in ("", COORDINATOR_SERVICE):
        servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    return servicer
