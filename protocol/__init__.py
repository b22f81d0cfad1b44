"""The coordinator/client gRPC contract (DESIGN.md §6); built with the federated-run issue."""
