"""`matformer-server`, the coordinator of a federated run: its config (run.toml), the round
state machine (`coordinator.py`) and the gRPC and HTTP sides around it. How the parts fit
together: docs/architecture.md.
"""
