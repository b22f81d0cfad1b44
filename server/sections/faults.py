"""[faults]: how the coordinator treats members that die, hang, lag or misbehave, and what one
member's calls may hold of the server."""

from __future__ import annotations

from dataclasses import dataclass

from matformer.modeling.settings import setting
from matformer.protocol.channel import MAX_MESSAGE_BYTES
from matformer.server.call_slots import CallLimits
from matformer.server.sections.checks import MAX_COUNT, MAX_SECONDS, MIN_IDLE_S, SECONDS, require

MIN_HEARTBEAT_S = 0.1  # more often, every member's heartbeats become a busy loop of calls
MIB = 1024 * 1024
MAX_MESSAGE_MB = MAX_MESSAGE_BYTES / MIB  # no client sends a larger message (protocol.channel)
MAX_SUBMISSION_MB = 1024.0 * 1024  # 1 TiB: a dense float32 submission of 270 G parameters
DEFAULT_PEER_CLIP = 2.0  # [faults] peer_clip: a member weighs at most twice a typical one
NORM_ACTIONS = ("clip", "reject")


@dataclass(kw_only=True, slots=True)
class FaultsSection:
    """How the coordinator treats clients that die, hang, lag or misbehave (docs/architecture.md,
    "Members that fail or misbehave").

    A member silent for ``heartbeat_timeout_s`` is dropped from the open round (its sequences
    go back to the queue) and counts as inactive until it calls again; silent for
    ``session_ttl_s``, it is removed and its session expires. Each round it misses halves the
    speed its share is sized by; ``miss_limit`` misses in a row move it to the next smaller
    allowed tier. Finishing within ``early_fraction`` of the deadline ``early_rounds`` times in
    a row offers it the next larger tier its memory and request allow. A submission that
    breaks a limit is refused and counted; ``max_rejections`` refusals exclude the client.
    A member that missed its last round and has handed nothing in since, not even late, is not
    waited for once the others have delivered (free riders take work and deliver nothing),
    and ``max_misses`` such rounds in a row exclude it. Each accepted result is scored by its
    agreement with its peers' (server/scores.py); a member whose mean score over its last
    ``score_rounds`` scored rounds is below ``min_score`` is excluded.
    """

    heartbeat_s: float = setting(5.0, low=MIN_HEARTBEAT_S, high=MAX_SECONDS, unit=SECONDS,
                                 help="how often clients heartbeat, also while training")
    heartbeat_timeout_s: float = setting(30.0, low=0, above=True, high=MAX_SECONDS, unit=SECONDS,
                                         help="silence after which a member counts as gone")
    session_ttl_s: float = setting(3600.0, low=0, above=True, high=MAX_SECONDS, unit=SECONDS,
                                   help="silence after which a member is removed (rejoin needed)")
    miss_limit: int = setting(2, low=0, high=MAX_COUNT, help=(
        "consecutive missed rounds before a smaller tier; 0: never"))
    max_misses: int = setting(6, low=0, high=MAX_COUNT, help=(
        "consecutive rounds a member is dropped from while handing nothing in, not even late, "
        "before it is excluded; 0: never"))
    early_fraction: float = setting(0.25, low=0, above=True, help=(
        "\"early\": submitted within this fraction of the deadline; below 1"))
    early_rounds: int = setting(5, low=0, high=MAX_COUNT, help=(
        "consecutive early rounds before a larger tier is offered; 0: never"))
    max_rejections: int = setting(3, low=0, high=MAX_COUNT, help=(
        "refused submissions before the client is excluded; 0: never"))
    score_rounds: int = setting(8, low=0, high=MAX_COUNT, help=(
        "scored rounds a member's mean agreement with its peers is taken over before it can "
        "exclude the member; 0: never"))
    min_score: float = setting(-0.05, low=-1, high=1, help=(
        "a member whose mean agreement (cosine with its peers' results, in [-1, 1]) is "
        "below this is excluded: its results push against the others'"))
    max_norm: float | None = setting(None, low=0, above=True, help=(
        "L2 bound on one submission's values; unset: unbounded"))
    norm_action: str = setting("reject", choices=NORM_ACTIONS, help=(
        "what a submission over max_norm gets: clipped to it, or refused"))
    # Each result's RMS is scaled down to at most this × the round's lower median for that
    # parameter, so no member steers an element by magnitude alone. On by default: it costs an
    # honest run less than its seed-to-seed spread (bench/README.md).
    peer_clip: float = setting(DEFAULT_PEER_CLIP, low=0, high=100, help=(
        "a result's RMS at most this × the round's lower median; 0: off, else at least 1"))
    max_submission_mb: float = setting(64.0, low=1, high=MAX_SUBMISSION_MB, unit=" MiB", help=(
        "one SubmitResult stream, all messages together"))
    max_message_mb: float = setting(64.0, low=1, high=MAX_MESSAGE_MB, unit=" MiB", help=(
        "any single gRPC message the server receives"))
    # What one member's calls may hold of the server (server/call_slots.py); an honest
    # client makes up to 4 calls at once (overlapped: a heartbeat beside an upload, the
    # sequences and an update), 3 of them streams.
    max_calls_per_member: int = setting(4, low=1, high=64, help=(
        "calls one member may hold at once"))
    max_streams_per_member: int = setting(3, low=1, high=64, help=(
        "... of them streams, at most max_calls_per_member"))
    max_streams: int = setting(16, low=1, high=1024, help=(
        "streams shared by all members; each member with work in the open round has one more"))
    stream_idle_s: float = setting(10.0, low=MIN_IDLE_S, high=MAX_SECONDS, unit=SECONDS,
                                   help="a stream waiting on its peer this much longer than "
                                   "its message needs at 8 Mbit/s is ended")
    request_idle_s: float = setting(10.0, low=MIN_IDLE_S, high=MAX_SECONDS, unit=SECONDS,
                                    help="a call whose request has not arrived in this long is "
                                    "ended")
    max_members: int = setting(512, low=1, high=100_000, help=(
        "members at once (silent ones count until session_ttl_s)"))
    max_joins_per_minute: int = setting(60, low=1, high=100_000, help=(
        "admissions; a burst of this many, then one per 60/N s"))

    def __post_init__(self) -> None:
        require(self.heartbeat_timeout_s >= 2 * self.heartbeat_s,
                f"[faults] heartbeat_timeout_s {self.heartbeat_timeout_s} must be at least twice "
                f"heartbeat_s {self.heartbeat_s}, or one late heartbeat drops a healthy client.")
        require(self.session_ttl_s >= self.heartbeat_timeout_s,
                f"[faults] session_ttl_s {self.session_ttl_s} must be >= heartbeat_timeout_s "
                f"{self.heartbeat_timeout_s}.")
        require(self.early_fraction < 1,
                f"[faults] early_fraction must lie in (0, 1), got {self.early_fraction}.")
        require(self.max_streams_per_member <= self.max_calls_per_member,
                f"[faults] needs 1 <= max_streams_per_member ({self.max_streams_per_member}) "
                f"<= max_calls_per_member ({self.max_calls_per_member}) <= 64.")
        require(self.peer_clip == 0 or self.peer_clip >= 1,
                f"[faults] peer_clip must be 0 (off) or lie in [1, 100], got {self.peer_clip}.")

    def call_limits(self) -> CallLimits:
        return CallLimits(per_member=self.max_calls_per_member,
                          streams_per_member=self.max_streams_per_member,
                          streams=self.max_streams, idle_s=self.stream_idle_s,
                          request_s=self.request_idle_s, members=self.max_members,
                          message_bytes=self.max_message_bytes)

    @property
    def max_submission_bytes(self) -> int:
        return int(self.max_submission_mb * MIB)

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mb * MIB)
