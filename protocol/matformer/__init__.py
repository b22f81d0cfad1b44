"""Versioned gRPC packages of Matformer's wire protocol (``matformer.v1``, ...)."""
