"""`matformer-client`: the participant of a federated run (``federated.py``) and standalone
training (``standalone.py``). Each concern has its module: the transport edge
(``connection.py``), checkpoint loading (``checkpoints.py``), the round's sequences
(``data.py``), local work (``local_round.py``), the replica (``replica.py``), error feedback
across restarts (``feedback_state.py``), the device probe (``probe.py``) and progress
(``progress.py``); see docs/architecture.md, "Packages"."""
