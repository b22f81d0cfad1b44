"""One round being collected: who trains what, and the results that came in
(docs/architecture.md, "One round"). What a submission must pass to be kept is the gate's
(``server/gate.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from matformer.modeling.compression import SparseResult


@dataclass(frozen=True, slots=True)
class RoundAssignment:
    """What one client trains this round."""

    round: int
    client_id: str
    tier: int
    sequence_ids: tuple[int, ...]  # ids of the run's MDAT view, in training order
    tokens: int  # Σ lengths of those sequences
    deadline: float  # clock time by which the results must be in
    assignment_id: str = ""  # names this split of this round; a submission quotes it


@dataclass(slots=True)
class Submission:
    results: dict[str, SparseResult]  # canonical name → result
    loss: float | None
    received_at: float
    wire_bytes: int = 0  # the submission's size as it arrived (compressed, protobuf-framed)


@dataclass(slots=True)
class OpenRound:
    index: int
    opened_at: float
    deadline: float
    assignments: dict[str, RoundAssignment]  # client id → its work
    queue_before: dict[str, Any]  # the work queue before this round took its ids
    submissions: dict[str, Submission] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)  # client id → why it left the round
    names: dict[str, str] = field(default_factory=dict)  # client id → its name, at opening

    def complete(self) -> bool:
        return all(c in self.submissions for c in self.assignments)

    def pending(self) -> list[str]:
        """The assigned members that have not submitted."""
        return [c for c in self.assignments if c not in self.submissions]
