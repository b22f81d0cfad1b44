"""`matformer-server`, the coordinator (DESIGN.md §1); built with the federated-run issue.

- ``server.config``: ``RunConfig.load("run.toml")``, the run's typed config (sections in
  ``server.sections``, read by ``server.tables``); ``examples/run.toml`` shows every key.
- ``server.tiers``: ``TierPolicy.assign(capabilities, members)``, which tier a joining client
  trains and why; ``server.memory`` estimates a tier's training memory.
- ``server.coordinator``: ``Coordinator(config)``, the run without transport: join, heartbeat,
  leave, submit, advance (rounds close when complete or at the deadline), updates since a
  round, the checkpoint a joiner loads; ``server.membership``, ``server.work`` (the queue of
  shuffled sequence ids, re-queued ids first), ``server.rounds``, ``server.update_log``,
  ``server.state`` (``state.json``) are its parts.
- ``server.service``: the gRPC servicer over the coordinator (auth, schema check, error codes);
  ``server.http``: ``/status``, ``/metrics`` and the checkpoints read-only under ``/files``;
  ``server.main``: ``matformer-server --config run.toml`` (gRPC + health, HTTP, round timer).
- ``server.errors``: ``ServerConfigError``, ``TierAssignmentError`` and ``CoordinatorError``
  families; each carries the gRPC status code a servicer answers with.
"""
