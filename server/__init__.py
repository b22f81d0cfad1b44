"""`matformer-server`, the coordinator (DESIGN.md §1); built with the federated-run issue."""
