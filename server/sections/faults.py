"""[faults]: how the coordinator treats members that die, hang, lag or misbehave, and what one
member's calls may hold of the server."""

from __future__ import annotations

import math
from dataclasses import dataclass

from protocol.channel import MAX_MESSAGE_BYTES
from server.call_slots import CallLimits
from server.sections.checks import MAX_SECONDS, require, within

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
    """

    heartbeat_s: float = 5.0  # how often clients heartbeat, also while training
    heartbeat_timeout_s: float = 30.0  # silence after which a member counts as gone
    session_ttl_s: float = 3600.0  # silence after which a member is removed (rejoin needed)
    miss_limit: int = 2  # consecutive missed rounds before a smaller tier; 0: never
    early_fraction: float = 0.25  # "early": submitted within this fraction of the deadline
    early_rounds: int = 5  # consecutive early rounds before a larger tier is offered; 0: never
    max_rejections: int = 3  # refused submissions before the client is excluded; 0: never
    max_norm: float | None = None  # L2 bound on one submission's values; None: unbounded
    norm_action: str = "reject"  # clip | reject, for a submission over max_norm
    # each result's RMS scaled down to at most this × the round's lower median for that
    # parameter, so no member steers an element by magnitude alone; 0: off. On by default:
    # it costs an honest run less than its seed-to-seed spread (bench/README.md)
    peer_clip: float = DEFAULT_PEER_CLIP
    max_submission_mb: float = 64.0  # one SubmitResult stream, all messages together
    max_message_mb: float = 64.0  # any single gRPC message the server receives
    # What one member's calls may hold of the server (server/call_slots.py); an honest
    # client makes up to 4 calls at once (overlapped: a heartbeat beside an upload, the
    # sequences and an update), 3 of them streams.
    max_calls_per_member: int = 4
    max_streams_per_member: int = 3
    # streams shared by all members; each member with work in the open round has one more
    max_streams: int = 16
    # a stream waiting on its peer this much longer than its message needs at 8 Mbit/s is ended
    stream_idle_s: float = 10.0
    request_idle_s: float = 10.0  # a call whose request has not arrived in this long is ended
    max_members: int = 512  # members at once (silent ones count until session_ttl_s)
    max_joins_per_minute: int = 60  # admissions; a burst of this many, then one per 60/N s

    def __post_init__(self) -> None:
        within("[faults] heartbeat_s", self.heartbeat_s, MIN_HEARTBEAT_S, MAX_SECONDS,
               unit=" seconds")
        for key in ("heartbeat_timeout_s", "session_ttl_s"):
            within(f"[faults] {key}", getattr(self, key), 0, MAX_SECONDS, above=True,
                   unit=" seconds")
        within("[faults] max_submission_mb", self.max_submission_mb, 1, MAX_SUBMISSION_MB,
               unit=" MiB")
        within("[faults] max_message_mb", self.max_message_mb, 1, MAX_MESSAGE_MB, unit=" MiB")
        require(self.heartbeat_timeout_s >= 2 * self.heartbeat_s,
                f"[faults] heartbeat_timeout_s {self.heartbeat_timeout_s} must be at least twice "
                f"heartbeat_s {self.heartbeat_s}, or one late heartbeat drops a healthy client.")
        require(self.session_ttl_s >= self.heartbeat_timeout_s,
                f"[faults] session_ttl_s {self.session_ttl_s} must be >= heartbeat_timeout_s "
                f"{self.heartbeat_timeout_s}.")
        for key in ("miss_limit", "early_rounds", "max_rejections"):
            value = getattr(self, key)
            require(value >= 0, f"[faults] {key} must be >= 0 (0 turns it off), got {value}.")
        require(0 < self.early_fraction < 1,
                f"[faults] early_fraction must lie in (0, 1), got {self.early_fraction}.")
        require(self.max_norm is None or (self.max_norm > 0 and math.isfinite(self.max_norm)),
                f"[faults] max_norm must be a positive number, got {self.max_norm}.")
        require(1 <= self.max_streams_per_member <= self.max_calls_per_member <= 64,
                f"[faults] needs 1 <= max_streams_per_member ({self.max_streams_per_member}) "
                f"<= max_calls_per_member ({self.max_calls_per_member}) <= 64.")
        within("[faults] max_streams", self.max_streams, 1, 1024)
        within("[faults] max_members", self.max_members, 1, 100_000)
        within("[faults] max_joins_per_minute", self.max_joins_per_minute, 1, 100_000)
        for key in ("stream_idle_s", "request_idle_s"):
            within(f"[faults] {key}", getattr(self, key), 0, MAX_SECONDS, above=True,
                   unit=" seconds")
        require(self.peer_clip == 0 or 1 <= self.peer_clip <= 100,
                f"[faults] peer_clip must be 0 (off) or lie in 1..100, got {self.peer_clip}.")
        require(self.norm_action in NORM_ACTIONS,
                f"[faults] norm_action {self.norm_action!r} is unknown; choose one of "
                f"{', '.join(NORM_ACTIONS)}.")

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
