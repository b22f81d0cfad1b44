"""The coordinator/client contract (DESIGN.md §6): ``server/`` and ``client/`` meet only here.

- ``protocol/matformer/v1/coordinator.proto``: the versioned service; its committed stubs are
  ``from protocol.matformer.v1 import coordinator_pb2, coordinator_pb2_grpc``
  (regenerate with ``python -m protocol.generate``).
- ``protocol.tensors``: ``encode_tensor`` / ``decode_tensor``, ``DTYPES``.
- ``protocol.sparse``: ``encode_sparse_result`` / ``decode_sparse_result`` (validated with
  ``modeling.compression.validate``).
- ``protocol.submission``: ``submission_messages`` (client) / ``read_submission`` (server).
- ``protocol.updates``: ``update_messages`` (server) / ``read_updates`` (client) of
  ``modeling.compression.RoundUpdate`` records, ``encode_step`` / ``decode_step``.
- ``protocol.files``: ``send_file`` / ``receive_file`` (chunks of ``CHUNK_BYTES``, sha256,
  atomic), ``resolve_inside``.
- ``protocol.auth``: ``SESSION_METADATA_KEY``, ``SessionTokens``, ``check_join_token``,
  ``require_session`` (server); ``with_session``, ``session_metadata`` (client);
  ``tokens_equal``, ``new_join_token``.
- ``protocol.health``: ``add_health(server)``, the standard ``grpc.health.v1`` service.
- ``protocol.channel``: ``GRPC_OPTIONS`` both ends pass, ``COORDINATOR_SERVICE``.
- ``protocol.errors``: ``ProtocolError`` and its subclasses, each with the gRPC ``code`` a
  coordinator answers it with.
"""
