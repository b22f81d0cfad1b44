"""One round being collected: who trains what, and the results that came in
(docs/architecture.md, "One round"). What a submission must pass to be kept is the gate's
(``server/gate.py``).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from matformer.modeling.compression import SparseResult
from matformer.server.errors import MissedNotAssigned


def deadline_after(now: float, deadlines: Sequence[float], deadline_s: float) -> float:
    """The deadline of a round opened at ``now`` behind rounds due at ``deadlines``: its own
    ``deadline_s`` after the last of them (members train them in order), or after ``now``.
    The root's rule, and a relay's for its members."""
    return max([now, *deadlines]) + deadline_s


def pulled_in(deadline: float, now: float, deadline_s: float) -> float:
    """The deadline of the round behind one that just ended at ``now``: its members are free
    for it from now, so it ends no later than ``deadline_s`` from now (else rounds that end
    early would push every later deadline a further ``deadline_s`` out)."""
    return min(deadline, now + deadline_s)


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

    def without(self, missed: Sequence[int], length_of: Callable[[int], int]
                ) -> RoundAssignment:
        """This work less the sequences ``missed`` (each id as often as it is named): what
        a relay delivered when some of its members did not. MissedNotAssigned names ids it
        does not hold."""
        left = Counter(self.sequence_ids)
        left.subtract(missed)
        foreign = sorted({i for i, n in left.items() if n < 0})
        if foreign:
            raise MissedNotAssigned(f"missed sequence ids {foreign[:5]} are not in "
                                    f"{self.client_id}'s assignment for round {self.round} "
                                    "(or are named more often than it holds them).")
        kept: list[int] = []
        for i in self.sequence_ids:
            if left[i] > 0:
                kept.append(i)
                left[i] -= 1
        return dataclasses.replace(self, sequence_ids=tuple(kept),
                                   tokens=sum(length_of(i) for i in kept))


@dataclass(slots=True)
class Submission:
    results: list[SparseResult]  # one per parameter; a relay's, one per parameter and tier
    loss: float | None
    received_at: float
    wire_bytes: int = 0  # the submission's size as it arrived (compressed, protobuf-framed)
    # a relay's loss per tier its members trained: tier → (loss, tokens); empty: ``loss`` is
    # the sender's, at its own tier
    tier_losses: dict[int, tuple[float, int]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Folded:
    """A late result as the round it is folded into takes it (``server/late.py``)."""

    assignment: RoundAssignment  # what it delivered (a relay's: less what its members missed)
    submission: Submission  # its results, their tokens scaled by ``weight``
    weight: float  # the share of its tokens the aggregate counts
    into: int  # the round it is folded into


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
    late: list[Folded] = field(default_factory=list)  # earlier rounds' results folded in

    def complete(self) -> bool:
        return all(c in self.submissions for c in self.assignments)

    def pending(self) -> list[str]:
        """The assigned members that have not submitted."""
        return [c for c in self.assignments if c not in self.submissions]
