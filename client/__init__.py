"""`matformer-client`, the training client (DESIGN.md §1); built with the federated-run issue."""
