"""The status API under ``/api/`` (read-only, open like every GET of the HTTP side), and
the models that FastAPI's OpenAPI schema (``/openapi.json``, browsable at ``/docs``) is
made from. The dashboard at ``/`` reads this API and nothing else.

- ``GET /api/run``: phase, round, tokens, the open round, each tier's last loss;
- ``GET /api/clients``: members (device, memory, tier and why, speed, share of the last
  round, last seen, rejections), the clients excluded and those that left (one record per
  name, the newest ``MAX_DEPARTED``), with why, and how many took part in the run;
- ``GET /api/loss?since_round=R``: training loss per tier per round;
- ``GET /api/held_out``: held-out loss per tier of the checkpoints evaluated so far
  (``server.held_out_log``; the coordinator reads it, others evaluate);
- ``GET /api/rounds?since_round=R``: each completed round: duration, slowest client, bytes
  sent against their dense size, who was dropped and why;
- ``GET /api/events?after=SEQ&limit=N``: joins, leaves, drops, re-tierings, exclusions,
  checkpoints, resumes, oldest first;
- ``GET /api/dashboard?since_round=R&events_after=SEQ``: all of the above from one
  snapshot, for a page that polls and appends what is new.

All of one response comes from one ``Coordinator.snapshot()``, so its parts agree (the
held-out figures come from their file, as it is then).

The API is public (the dashboard is a read-only page for anyone), so no text it serves holds
a filesystem path of this machine (``hide_paths``: a path keeps only its last part), and why
a client was excluded (the operator's words, or the refusals behind an automatic exclusion)
is shown only to a request with ``Authorization: Bearer <operator token>``; others read
``WITHHELD`` there.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from matformer.server.coordinator import Coordinator
from matformer.server.held_out_log import HeldOutLog
from matformer.server.history import MAX_DEPARTED, EventKind
from matformer.server.operator_access import operator_reader

EVENTS_LIMIT = 200  # the most events one response carries unless asked for fewer
WITHHELD = "(the reason is shown to the operator only)"
EXCLUDED = "excluded: "  # how the coordinator's round records begin an exclusion's reason
# An absolute path: a "/" at the start or after a space, quote, bracket, "=" or ",", and the
# characters up to the next of those ("tokens/s" and "1/2" are not paths, "://" is left alone).
_ABSOLUTE_PATH = re.compile(r"(?<![^\s'\"(\[{=,])/[^\s'\"()\[\]{},;]+")


def hide_paths(text: str) -> str:
    """``text`` with every absolute path cut to its last part: ``…/state.json``."""
    return _ABSOLUTE_PATH.sub(lambda m: "…/" + m.group().rstrip("/").rpartition("/")[2], text)


PublicText = Annotated[str, AfterValidator(hide_paths)]  # free text that may quote a path

Phase = Literal["waiting", "collecting", "finished"]
ClientState = Literal["training", "submitted", "idle", "silent"]


class Strict(BaseModel):
    """A response part whose schema lists every field it may carry (additionalProperties:
    false), so a client generated from /openapi.json can rely on it."""

    model_config = ConfigDict(extra="forbid")


class LossPoint(Strict):
    round: int
    loss: float = Field(description="token-weighted mean training loss its clients reported")


class HeldOutPoint(Strict):
    round: int = Field(description="the checkpoint round-N: the weights round N starts from")
    loss: float = Field(description="mean loss per target token on the run's held-out "
                                    "sequences")
    sequences: int = Field(description="held-out sequences it was measured on")


class OpenRoundInfo(Strict):
    round: int
    opened_at: float = Field(description="server clock, seconds since the epoch")
    deadline: float = Field(description="server clock, seconds since the epoch")
    tokens: int = Field(description="tokens handed out in this round")
    assigned: list[str] = Field(description="client ids training in this round")
    submitted: list[str] = Field(description="client ids whose results are in")


class RunInfo(Strict):
    run_id: str
    phase: Phase = Field(description="waiting: fewer than min_clients active; collecting: a "
                                     "round is open; finished: the planned rounds or tokens "
                                     "are done")
    round: int = Field(description="rounds completed, i.e. the index of the next round")
    tokens: int = Field(description="tokens trained on in completed rounds")
    rounds_planned: int | None
    tokens_planned: int | None
    min_clients: int
    allowed_tiers: list[int] = Field(description="every tier a member may be given, the "
                                                "Mix'n'Match slices' ids (64 and up) last")
    layer_mixes: list[list[int]] = Field(default=[], description=(
        "[tiers] layer_mixes: tier 64 + k trains layer_mixes[k], one tier per layer"))
    checkpoints: list[int] = Field(description="rounds with a checkpoint")
    last_loss: dict[str, LossPoint] = Field(description="tier → its loss in the last round "
                                                        "it trained: a finished run's final")
    open_round: OpenRoundInfo | None
    server_time: float = Field(description="the server clock when this was read; ages "
                                           "(last seen) are relative to it")


class RelayedInfo(Strict):
    name: str
    tier: int
    tokens_per_second: float = Field(description="as the relay measured it")


class ClientInfo(Strict):
    client_id: str
    name: str
    device_kind: str = Field(description="cpu | cuda | mps")
    device_name: str = Field(description="e.g. the GPU or CPU model; empty if not reported")
    memory_bytes: int = Field(description="memory the client reported it can train in")
    tier: int
    tier_reason: PublicText = Field(description="why this tier: the join's reasoning, or "
                                                "the re-tiering that moved it")
    requested_tier: int | None
    tokens_per_second: float = Field(description="measured in its last delivered round, "
                                                 "else its own report")
    speed_measured: bool = Field(description="tokens_per_second comes from a round")
    last_round: int | None = Field(description="the last completed round it delivered in")
    last_round_share: float = Field(description="its fraction of that round's tokens")
    last_round_seconds: float = Field(description="from that round's opening to its results")
    last_seen: float = Field(description="server clock of its last call")
    last_seen_s_ago: float
    longest_silence_s: float = Field(description="the longest time between two of its calls "
                                                 "since it joined (heartbeats included)")
    state: ClientState = Field(description="training or submitted (in the open round), idle "
                                           "(not in it), silent (no call within "
                                           "heartbeat_timeout_s)")
    rejections: int = Field(description="submissions refused as bad results")
    missed: int = Field(description="rounds missed in a row")
    score: float | None = Field(description="its last delivered round's agreement with its "
                                            "peers: the cosine between its result and theirs, "
                                            "in [-1, 1]; null where that round was not scored")
    score_mean: float | None = Field(description="the mean of its last [faults] score_rounds "
                                                 "scores, which excludes it below [faults] "
                                                 "min_score; null before its first")
    bytes_up: int = Field(description="bytes of its submissions since it joined, as received")
    bytes_down: int = Field(description="bytes sent to it since it joined: updates, sequences "
                                        "and checkpoint files (before gRPC's compression)")
    dense_bytes_up: int = Field(description="float32 of its tier's weights per submission: "
                                            "what dense gradients would have taken")
    dense_bytes_down: int = Field(description="float32 of its tier's weights per round update "
                                              "it downloaded: what dense weights would take")
    compute_utilization: float | None = Field(
        description="training seconds it reported for its last round over that round's "
                    "seconds from opening to its results; null before its first round")
    behind: list[RelayedInfo] = Field(description="a relay's members, as its last heartbeat "
                                                  "listed them; empty for any other member")


class ExcludedClient(Strict):
    client_id: str
    name: str
    reason: PublicText = Field(description=f"shown to the operator only; others read "
                                           f"{WITHHELD!r}")


class DepartedClient(Strict):
    client_id: str
    name: str
    tier: int
    device_kind: str
    device_name: str
    tokens_per_second: float = Field(description="its speed when it left")
    last_round: int | None = Field(description="the last completed round it delivered in")
    left_at: float = Field(description="server clock")
    round: int = Field(description="rounds completed when it left")
    reason: PublicText = Field(description="what it said when leaving, or why its session "
                                           "expired")
    leaves: int = Field(description="how often a member of this name left: each time "
                                    "replaces its record, the latest kept")


class Clients(Strict):
    members: list[ClientInfo]
    excluded: list[ExcludedClient]
    departed: list[DepartedClient] = Field(description="members that left, one record per "
                                                       f"name, newest last (the last "
                                                       f"{MAX_DEPARTED})")
    departed_beyond: int = Field(description="members that left before those listed")
    took_part: int = Field(description="members of the run from its start, one per name: "
                                       "those here, those that left and those excluded")


class DroppedClient(Strict):
    client_id: str
    name: str
    reason: PublicText = Field(description=f"an exclusion's reason is shown to the operator "
                                           f"only: {EXCLUDED}{WITHHELD}")


class ScoredResult(Strict):
    client_id: str
    name: str
    score: float = Field(description="cosine between its result and its peers' "
                                     "token-weighted sum, over the coordinates it sent")


class LateResult(Strict):
    client_id: str
    name: str
    round: int = Field(description="the round whose deadline it missed")
    tokens: int
    weight: float = Field(description="the share of its tokens the aggregate counted "
                                      "([round] late_weight per round late)")


class RoundRecord(Strict):
    round: int
    opened_at: float
    closed_at: float
    duration_s: float
    tokens: int
    clients: int = Field(description="clients that delivered results")
    slowest_client_id: str
    slowest_name: str
    slowest_s: float = Field(description="from the round's opening to the slowest results")
    close_s: float = Field(0.0, description="its close, from the last results (or the "
                                            "deadline) to the update's record; 0 in records "
                                            "written before it was kept")
    bytes_sent: int = Field(description="the results as they arrived: compressed, framed")
    bytes_dense: int = Field(description="the same results as dense float32 tensors of the "
                                         "regions they cover")
    dropped: list[DroppedClient] = Field(description="clients whose work was handed back")
    scores: list[ScoredResult] = Field([], description=(
        "each scored result's agreement with its peers'; empty in a round of fewer than three "
        "results, and in records written before scores were kept"))
    late: list[LateResult] = Field([], description=(
        "results of earlier rounds that missed their deadline, folded into this one "
        "([round] late_rounds)"))


class Event(Strict):
    seq: int = Field(description="numbers events in order; ask for those after one")
    time: float
    round: int
    kind: EventKind
    client_id: str | None
    name: str | None = Field(None, description="the member's name, where the event is about "
                                                "a member")
    detail: PublicText = Field(description=f"an exclusion's reason is shown to the operator "
                                           f"only; others read {WITHHELD!r}")


class Dashboard(Strict):
    run: RunInfo
    clients: Clients
    loss: dict[str, list[LossPoint]] = Field(description="tier → points, by round")
    held_out: dict[str, list[HeldOutPoint]] = Field(description="tier → the checkpoints "
                                                               "evaluated so far, by round")
    rounds: list[RoundRecord]
    events: list[Event]


def build_router(coordinator: Coordinator, held_out: HeldOutLog,
                 operator_token: str | None) -> APIRouter:
    api = APIRouter(prefix="/api", tags=["status"])
    since = Query(0, ge=0, description="only rounds with this index or later")
    reader = Depends(operator_reader(operator_token))  # True: the request has the token

    @api.get("/run")
    def run() -> RunInfo:
        return run_info(coordinator.snapshot(since_round=None, events_after=None))

    @api.get("/clients")
    def clients(operator: bool = reader) -> Clients:
        return clients_info(coordinator.snapshot(since_round=None, events_after=None), operator)

    @api.get("/loss")
    def loss(since_round: int = since) -> dict[str, list[LossPoint]]:
        return loss_info(coordinator.snapshot(since_round=since_round, events_after=None))

    @api.get("/held_out")
    def held_out_loss() -> dict[str, list[HeldOutPoint]]:
        return held_out_info(held_out)

    @api.get("/rounds")
    def rounds(since_round: int = since, operator: bool = reader) -> list[RoundRecord]:
        snap = coordinator.snapshot(since_round=since_round, events_after=None)
        return rounds_info(snap["rounds"], operator)

    @api.get("/events")
    def events(after: int = Query(-1, ge=-1, description="only events with a larger seq"),
               limit: int = Query(EVENTS_LIMIT, ge=1, le=1000,
                                  description="the newest this many"),
               operator: bool = reader) -> list[Event]:
        snap = coordinator.snapshot(since_round=None, events_after=after)
        return events_info(snap["events"][-limit:], operator)

    @api.get("/dashboard")
    def dashboard(since_round: int = since,
                  events_after: int = Query(-1, ge=-1, description="only events with a "
                                                                    "larger seq"),
                  operator: bool = reader) -> Dashboard:
        snap = coordinator.snapshot(since_round=since_round, events_after=events_after)
        return Dashboard(run=run_info(snap), clients=clients_info(snap, operator),
                         loss=loss_info(snap), held_out=held_out_info(held_out),
                         rounds=rounds_info(snap["rounds"], operator),
                         events=events_info(snap["events"][-EVENTS_LIMIT:], operator))

    return api


def run_info(snap: dict[str, Any]) -> RunInfo:
    opened = snap["open_round"]
    return RunInfo(run_id=snap["run_id"], phase=snap["phase"], round=snap["round"],
                   tokens=snap["tokens"], rounds_planned=snap["rounds_planned"],
                   tokens_planned=snap["tokens_planned"], min_clients=snap["min_clients"],
                   allowed_tiers=snap["allowed_tiers"], layer_mixes=snap["layer_mixes"],
                   checkpoints=snap["checkpoints"],
                   last_loss={tier: LossPoint(round=int(r), loss=loss)
                              for tier, (r, loss) in sorted(snap["last_loss"].items(),
                                                            key=lambda kv: int(kv[0]))},
                   open_round=None if opened is None else OpenRoundInfo(**opened),
                   server_time=snap["now"])


def clients_info(snap: dict[str, Any], operator: bool) -> Clients:
    now, opened = snap["now"], snap["open_round"]
    members = []
    for m in snap["members"]:
        age = max(now - m["last_seen"], 0.0)
        if age > snap["heartbeat_timeout_s"]:
            state = "silent"
        elif opened is not None and m["client_id"] in opened["submitted"]:
            state = "submitted"
        elif opened is not None and m["client_id"] in opened["assigned"]:
            state = "training"
        else:
            state = "idle"
        members.append(ClientInfo(
            client_id=m["client_id"], name=m["name"], device_kind=m["device_kind"],
            device_name=m["device_name"], memory_bytes=m["memory_bytes"], tier=m["tier"],
            tier_reason=m["tier_reason"], requested_tier=m["requested_tier"],
            tokens_per_second=m["tokens_per_second"], speed_measured=m["measured_by_round"],
            last_round=m["last_round"], last_round_share=m["last_round_share"],
            last_round_seconds=m["last_round_seconds"], last_seen=m["last_seen"],
            last_seen_s_ago=age, longest_silence_s=m["longest_silence_s"], state=state,
            rejections=m["rejections"], score=m["score"], score_mean=m["score_mean"],
            missed=m["missed"], bytes_up=m["bytes_up"], bytes_down=m["bytes_down"],
            dense_bytes_up=m["dense_bytes_up"], dense_bytes_down=m["dense_bytes_down"],
            compute_utilization=(min(m["last_round_compute_s"] / m["last_round_seconds"], 1.0)
                                 if m["last_round_seconds"] > 0 else None),
            behind=[RelayedInfo(**r) for r in m["relayed"]]))
    excluded = [ExcludedClient(**{**e, "reason": e["reason"] if operator else WITHHELD})
                for e in snap["excluded"]]
    named = {m["name"] for m in snap["members"]} | {d["name"] for d in snap["departed"]} | {
        e["name"] or e["client_id"] for e in snap["excluded"]}
    return Clients(members=members, excluded=excluded,
                   departed=[DepartedClient(**d) for d in snap["departed"]],
                   departed_beyond=snap["departed_beyond"],
                   took_part=len(named) + snap["departed_beyond"])


def rounds_info(rounds: list[dict[str, Any]], operator: bool) -> list[RoundRecord]:
    def dropped(d: dict[str, Any]) -> dict[str, Any]:
        withheld = not operator and d["reason"].startswith(EXCLUDED)
        return {**d, "reason": EXCLUDED + WITHHELD} if withheld else d

    return [RoundRecord(**{**r, "dropped": [dropped(d) for d in r["dropped"]]}) for r in rounds]


def events_info(events: list[dict[str, Any]], operator: bool) -> list[Event]:
    return [Event(**{**e, "detail": WITHHELD}) if e["kind"] == "exclude" and not operator
            else Event(**e) for e in events]


def loss_info(snap: dict[str, Any]) -> dict[str, list[LossPoint]]:
    return {tier: [LossPoint(round=int(r), loss=loss) for r, loss in points]
            for tier, points in sorted(snap["loss"].items(), key=lambda kv: int(kv[0]))}


def held_out_info(log: HeldOutLog) -> dict[str, list[HeldOutPoint]]:
    return {tier: [HeldOutPoint(round=r, loss=loss, sequences=n) for r, loss, n in points]
            for tier, points in log.points().items()}
