"""`matformer-server`, the coordinator (DESIGN.md §1); built with the federated-run issue.

- ``server.config``: ``RunConfig.load("run.toml")``, the run's typed config (sections in
  ``server.sections``, read by ``server.tables``); ``examples/run.toml`` shows every key.
- ``server.tiers``: ``TierPolicy.assign(capabilities, members)``, which tier a joining client
  trains and why; ``server.memory`` estimates a tier's training memory.
- ``server.errors``: ``ServerConfigError`` and ``TierAssignmentError`` families.
"""
