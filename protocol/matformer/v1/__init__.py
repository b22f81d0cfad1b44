"""``matformer.v1``: ``coordinator.proto`` and the stubs ``protocol.generate`` makes from it."""
