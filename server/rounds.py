"""One open round: who trains what, and the results that came in (docs/architecture.md,
"One round").

A submission is checked whole before any of it is kept, so a rejected one leaves the round
(and later the aggregate) exactly as it was. Checks, in order: the round is the one being
collected, the client has an assignment in it and has not submitted yet, and each result
names a known parameter once, covers exactly the client's tier region of that parameter's
universal shape, and passes modeling's own validation (indices, NaN/Inf, tokens).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from modeling.compression import Region, SparseResult, validate
from modeling.errors import CompressionError
from server.errors import (
    AlreadySubmitted,
    DuplicateResult,
    MalformedResult,
    NotInRound,
    StaleAssignment,
    StaleRound,
    UnknownParameter,
    WrongRegion,
)


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

    def check(self, client_id: str, round_index: int, results: Sequence[SparseResult],
              shapes: Mapping[str, tuple[int, ...]], region: Mapping[str, Region],
              assignment_id: str | None = None) -> None:
        """Raise the matching BadResult (or NotInRound) unless the submission can be kept."""
        if round_index != self.index:
            raise StaleRound(f"results for round {round_index}, but round {self.index} is being "
                             "collected; drop them and fetch the current assignment.")
        if client_id not in self.assignments:
            raise NotInRound(f"{client_id} has no assignment in round {self.index} (it joined "
                             "after it opened or was dropped at its deadline); wait for the "
                             "next round.")
        expected = self.assignments[client_id].assignment_id
        if assignment_id is not None and assignment_id != expected:
            raise StaleAssignment(
                f"results for assignment {assignment_id!r}, but {client_id}'s assignment in "
                f"round {self.index} is {expected!r} (the coordinator restarted and split the "
                "round anew); drop them and fetch the current assignment.")
        if client_id in self.submissions:
            raise AlreadySubmitted(f"{client_id} already submitted for round {self.index}; a "
                                  "client submits once per round.")
        seen: set[str] = set()
        for result in results:
            name = result.name
            if name not in shapes:
                raise UnknownParameter(f"{name!r} is not a parameter of this run's model; send "
                                       "canonical names (modeling.naming).")
            if name in seen:
                raise DuplicateResult(f"{name} appears twice in {client_id}'s submission for "
                                      f"round {self.index}; send one result per parameter.")
            seen.add(name)
            if tuple(result.shape) != shapes[name] or tuple(map(tuple, result.region)) != tuple(
                    region[name]):
                raise WrongRegion(
                    f"{name}: shape {tuple(result.shape)} region {result.region} is not this "
                    f"client's tier {self.assignments[client_id].tier} region {region[name]} of "
                    f"shape {shapes[name]}; the client trains the wrong tier or model, so it "
                    "should rejoin.")
            try:
                validate(result)
            except CompressionError as err:
                raise MalformedResult(str(err)) from err

    def complete(self) -> bool:
        return all(c in self.submissions for c in self.assignments)
