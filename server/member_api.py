"""What the gRPC service (server/service.py) asks of whoever answers a run's members: the
root's ``Coordinator``, or a relay (``relay.relay.Relay``) standing in for it near its
members. One servicer serves both over this interface, so a member cannot tell them apart
and a rule of the contract has one home.

    service = CoordinatorService(coordinator, limits)   # the root
    service = CoordinatorService(relay, limits)         # a relay

Everything here is the project's own records: the service turns messages into them and
back, and refusals into statuses (each error's ``code``). Only the two streams that are
relayed byte for byte, a round's update messages and a checkpoint file's chunks, pass
through as the messages they are.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from torch import Tensor

from matformer.modeling.compression import SparseResult
from matformer.protocol.records import ServedCheckpoint, SubmitHeader
from matformer.protocol.settings import RunSettings
from matformer.protocol.sparse import ResultLayout
from matformer.server.rounds import RoundAssignment
from matformer.server.tiers import Capabilities, TierAssignment


@dataclass(frozen=True, slots=True)
class JoinAsk:
    """A Join as the run reads it."""

    capabilities: Capabilities
    join_token: str  # the run's token, or ([auth] mode = "keys") the client's own key
    run_id: str = ""  # "": any run
    schema_hash: str | None = None  # the client's model's, when it says
    previous_session: str | None = None  # a restarted client's, to take its name back


@dataclass(frozen=True, slots=True)
class Joined:
    """What a member learns on joining."""

    client_id: str
    session_token: str
    tier: TierAssignment
    round: int  # rounds the run has closed
    checkpoint: ServedCheckpoint | None  # None: start from the run's initial weights
    settings: RunSettings
    schema_hash: str
    rounds_planned: int = 0  # [round] rounds, when that stop comes first; 0 for none
    tokens_planned: int = 0


@dataclass(frozen=True, slots=True)
class Waiting:
    """No work for the member now: ask again after ``retry_after_s``, or never
    (``finished``)."""

    round: int
    run_tokens: int
    retry_after_s: float = 0.0
    finished: bool = False


@dataclass(frozen=True, slots=True)
class Expected:
    """What a submission's header names, checked before any result is read: the assignment,
    and the layout each result must have (a relay's partials: by parameter and region)."""

    assignment: RoundAssignment
    layouts: Mapping[Any, ResultLayout]
    partials: bool = False


class MemberAPI(Protocol):
    """The run as its members' service sees it. Every method raises the run's own errors
    (``server.errors``), which carry their status."""

    clock: Callable[[], float]  # the clock assignments' deadlines are on

    @property
    def sequence_length(self) -> int: ...  # a client that names no microbatch runs one

    @property
    def run_tokens(self) -> int: ...  # tokens of the rounds closed so far

    def admit(self, ask: JoinAsk) -> Joined: ...

    def authenticate(self, token: str) -> str: ...  # the session's client id

    def heartbeat(self, client_id: str, *, tokens_per_second: float | None = None,
                  relayed: Sequence[tuple[str, int, float]] = ()) -> Any: ...

    def closed_rounds(self) -> int: ...

    def leave(self, client_id: str, reason: str = "") -> None: ...

    def work(self, client_id: str, after: int | None) -> RoundAssignment | Waiting: ...

    def pending(self, client_id: str) -> list[RoundAssignment]: ...

    def sequences(self, client_id: str, ids: Sequence[int]
                  ) -> Iterator[tuple[int, Tensor]]: ...

    def expects(self, client_id: str, header: SubmitHeader) -> Expected: ...

    def submit_results(self, client_id: str, header: SubmitHeader,
                       results: Sequence[SparseResult], *, wire_bytes: int) -> None: ...

    def rejected(self, client_id: str, error: Exception) -> str: ...

    def max_submission_bytes(self) -> int: ...

    def update_rounds(self, client_id: str, since_round: int, tier: int | None,
                      wait_s: float) -> Iterator[Iterable[Any]]: ...

    def checkpoint(self, client_id: str) -> ServedCheckpoint: ...

    def checkpoint_chunks(self, path: str) -> Iterator[Any]: ...

    def downloaded(self, client_id: str, nbytes: int, *, rounds: int = 0) -> None: ...
