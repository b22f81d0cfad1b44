"""What a relay holds of a round: its members, the root's round it holds, and each member's
part of it (relay/relay.py moves them on)."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from matformer.modeling.compression import SparseResult
from matformer.relay.upstream import RootWork
from matformer.server.rounds import RoundAssignment


@dataclass(kw_only=True, slots=True)
class RelayMember:
    client_id: str
    name: str
    tier: int
    tokens_per_second: float  # shown by a part it delivered, else its own claim
    last_seen: float
    measured_by_round: bool = False  # tokens_per_second comes from a part it delivered
    missed: int = 0  # held rounds in a row it delivered nothing in


@dataclass(kw_only=True, slots=True)
class Part:
    """One member's part of the held round, and what it delivered."""

    assignment: RoundAssignment
    results: list[SparseResult] | None = None
    loss: float = 0.0
    delivered_at: float = 0.0


@dataclass(kw_only=True, slots=True)
class HeldRound:
    work: RootWork  # the root's assignment to the relay
    sequences: dict[int, Tensor]  # each sequence's tokens
    parts: dict[str, Part]  # client id → its part
    opened: float
    deadline: float
    missed: set[str] = field(default_factory=set)  # members gone before they delivered

    def done(self, now: float) -> bool:
        return now >= self.deadline or all(
            p.results is not None or c in self.missed for c, p in self.parts.items())
