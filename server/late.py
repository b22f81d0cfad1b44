"""Late results: work that missed its round's deadline, folded into a later round instead of
being trained again (docs/architecture.md, "Late results").

    late = LateWork(rounds=2, weight=1.0)
    late.hold(assignment)               # a member missed round r: its ids wait here, not queued
    late.find(client, r, assignment_id) # ... its submission for r comes in: the gate asks
    late.keep(delivered, submission, assignment_id=...)  # ... kept until a round detaches
    folded, expired = late.take(r + 1)  # round r + 1 detaches: what it folds in, ids to requeue

A held assignment may still be delivered until ``rounds`` rounds after its own have been
detached for their close; then its ids go back to the queue, as they went at the deadline
before. A result kept by then is folded into the next round to close, its weight its tokens
times ``weight`` for each round it is late (1.0: a late token counts as a fresh one).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from matformer.server.rounds import Folded, RoundAssignment, Submission


class LateWork:
    """The assignments of rounds that closed without them, while their results may still
    come (held), and the results that came (kept), until a round folds them in."""

    def __init__(self, rounds: int, weight: float) -> None:
        self.rounds = rounds  # how many rounds after its own a result may still be folded in
        self.weight = weight  # a late result's weight per round late
        self.held: dict[str, RoundAssignment] = {}  # assignment id → the work, not delivered
        self.kept: dict[str, tuple[RoundAssignment, Submission]] = {}  # assignment id → ...

    @property
    def on(self) -> bool:
        return self.rounds > 0

    def hold(self, assignment: RoundAssignment) -> None:
        """A member missed ``assignment``'s round: its ids wait here for its late result."""
        self.held[assignment.assignment_id] = assignment

    def find(self, client_id: str, round_index: int, assignment_id: str | None
             ) -> RoundAssignment | None:
        """The held assignment a late submission's header names (None: not held)."""
        for held in self.held.values():
            if held.client_id == client_id and held.round == round_index and (
                    assignment_id is None or assignment_id == held.assignment_id):
                return held
        return None

    def keep(self, delivered: RoundAssignment, submission: Submission, *,
             assignment_id: str) -> None:
        """A late result that passed the gate, kept until the next round detaches."""
        self.held.pop(assignment_id, None)  # not held: its round had not closed yet
        self.kept[assignment_id] = (delivered, submission)

    def take(self, closing: int) -> tuple[list[Folded], list[RoundAssignment]]:
        """Round ``closing`` detaches for its close: the results kept so far, folded into it
        (oldest round first, then by member), and the held assignments whose bound it
        reaches, which no later round can take (their ids go back to the queue)."""
        folded = []
        for delivered, submission in sorted(self.kept.values(),
                                            key=lambda k: (k[0].round, k[0].client_id)):
            weight = self.weight ** (closing - delivered.round)
            folded.append(Folded(delivered, _weighed(submission, weight), weight, closing))
        self.kept.clear()
        expired = [a for a in self.held.values() if closing - a.round >= self.rounds]
        for assignment in expired:
            del self.held[assignment.assignment_id]
        return folded, expired

    def drop(self, client_id: str) -> list[RoundAssignment]:
        """A member that left or was excluded delivers nothing more: its held work."""
        gone = [a for a in self.held.values() if a.client_id == client_id]
        for assignment in gone:
            del self.held[assignment.assignment_id]
        return gone

    def ids(self) -> list[int]:
        """Every sequence id waiting here, held or kept (oldest round first): what the saved
        queue puts at its front, since a restarted coordinator knows nothing of them."""
        waiting = [*self.held.values(), *(a for a, _ in self.kept.values())]
        return [i for a in sorted(waiting, key=lambda a: (a.round, a.client_id))
                for i in a.sequence_ids]

    def snapshot(self) -> tuple[dict[str, RoundAssignment],
                                dict[str, tuple[RoundAssignment, Submission]]]:
        return dict(self.held), dict(self.kept)

    def restore(self, snapshot: tuple[dict[str, RoundAssignment],
                                      dict[str, tuple[RoundAssignment, Submission]]]) -> None:
        self.held, self.kept = dict(snapshot[0]), dict(snapshot[1])

    def requeue(self, assignments: Sequence[RoundAssignment],
                put_back: Callable[[Sequence[int]], None]) -> None:
        """Hand ``assignments``' ids back to the queue, the youngest round's first, so the
        oldest's come out first again."""
        for assignment in sorted(assignments, key=lambda a: (a.round, a.client_id),
                                 reverse=True):
            put_back(assignment.sequence_ids)


def _weighed(submission: Submission, weight: float) -> Submission:
    """``submission`` with each result's tokens, its weight in the aggregate, times
    ``weight`` (at least 1 token)."""
    if weight == 1.0:
        return submission
    return dataclasses.replace(submission, results=[
        dataclasses.replace(r, tokens=max(1, round(r.tokens * weight)))
        for r in submission.results])
