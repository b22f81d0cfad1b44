"""The submission gate: every check a submission passes before the coordinator keeps any of it
(docs/architecture.md, "Members that fail or misbehave").

In the order a submission meets them:

1. ``header``: the sender is who its session says, its loss and time are numbers a machine
   reports, and it names a round being collected, an assignment of the sender in it (the one
   it quotes) that has not been submitted yet. Checked before any result is read.
2. The layout of each result against the run's, from its declared dtypes and shapes alone,
   before it is decoded (``protocol/sparse.py``, called by the service as it reads them).
3. ``results``: each names a parameter once, covers exactly the sender's tier region of it,
   passes modeling's validation (ids, indices, NaN/Inf: done once, by the decoder, for what
   comes off the wire; ``ValidResult``); the token count is the assignment's
   and the reported loss and speed are physically possible; values and norm are within
   ``[faults]`` (``server/limits.py``: clipped or refused).

A member's FetchSequences request meets ``check_fetch`` before any sequence is read.

A refusal raises the ``BadResult`` (or ``StaleRound``/``NotInRound``) that names it; the
gate never changes the round, so a refused submission leaves everything as it was.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

from matformer.modeling.compression import Region, SparseResult, ValidResult, validate
from matformer.modeling.errors import CompressionError
from matformer.server.errors import (
    AlreadySubmitted,
    BadReport,
    DuplicateResult,
    MalformedResult,
    NotInRound,
    RepeatedSequenceIds,
    StaleAssignment,
    StaleRound,
    UnknownParameter,
    UnknownSequence,
    WrongRegion,
    WrongTokenCount,
)
from matformer.server.limits import SubmissionLimits
from matformer.server.rounds import OpenRound, RoundAssignment
from matformer.server.tiers import MAX_TOKENS_PER_SECOND

MAX_LOSS = 1e4  # nats per token; a random model's loss is ln(vocab_size), about 10
# client id, round, assignment id → the assignment a late result may still deliver, or None
LateLookup = Callable[[str, int, str | None], RoundAssignment | None]


class SubmissionGate:
    def __init__(self, shapes: Mapping[str, tuple[int, ...]], limits: SubmissionLimits) -> None:
        self.shapes = shapes  # canonical name → universal shape
        self.limits = limits

    def header(self, rounds: Sequence[OpenRound], client_id: str, round_index: int,
               assignment_id: str | None = None, *, now: float, finished: bool = False,
               late: LateLookup | None = None) -> tuple[OpenRound | None, RoundAssignment]:
        """The round being collected (of ``rounds``, and not past its deadline at ``now``)
        and the sender's assignment in it that a submission's header names; StaleRound,
        NotInRound, StaleAssignment or AlreadySubmitted else. Where the answer would be
        StaleRound, ``late`` may still name the assignment a late result delivers: then no
        round, and that assignment."""
        if finished:
            raise StaleRound(f"the run is finished; round {round_index}'s results are not "
                             "needed.")
        try:
            return self._header(rounds, client_id, round_index, assignment_id, now=now)
        except StaleRound as refused:
            held = None if late is None or isinstance(refused, StaleAssignment) else late(
                client_id, round_index, assignment_id)
            if held is None:
                raise
            return None, held

    def _header(self, rounds: Sequence[OpenRound], client_id: str, round_index: int,
                assignment_id: str | None, *, now: float) -> tuple[OpenRound, RoundAssignment]:
        rnd = next((r for r in rounds if r.index == round_index), None)
        if rnd is None:
            collected = ", ".join(str(r.index) for r in rounds) or "none"
            raise StaleRound(f"results for round {round_index}, but the rounds being collected "
                             f"are {collected}; drop them and fetch the current assignment.")
        assigned = rnd.assignments.get(client_id)
        if assigned is None:
            raise NotInRound(f"{client_id} has no assignment in round {rnd.index} (it joined "
                             "after it opened or was dropped from it); wait for the next "
                             "round.")
        if assignment_id is not None and assignment_id != assigned.assignment_id:
            raise StaleAssignment(
                f"results for assignment {assignment_id!r}, but {client_id}'s assignment in "
                f"round {rnd.index} is {assigned.assignment_id!r} (the round's work was "
                "handed out anew: the member missed its deadline, or the coordinator "
                "restarted); drop them and fetch the current assignment.")
        if client_id in rnd.submissions:
            raise AlreadySubmitted(f"{client_id} already submitted for round {rnd.index}; a "
                                   "client submits once per round.")
        if now >= rnd.deadline:  # the close worker ends it at its next look
            raise StaleRound(f"round {round_index} is past its deadline; drop its results "
                             "and fetch the current assignment.")
        return rnd, assigned

    def results(self, assigned: RoundAssignment, region: Mapping[str, Region],
                results: Sequence[SparseResult], *, loss: float | None,
                train_seconds: float | None) -> list[SparseResult]:
        """``results`` as the coordinator keeps them (clipped by the limits), or the
        BadResult that refuses the whole submission."""
        seen: set[str] = set()
        valid: list[ValidResult] = []
        for result in results:
            name = result.name
            if name not in self.shapes:
                raise UnknownParameter(f"{name!r} is not a parameter of this run's model; send "
                                       "canonical names (modeling.naming).")
            if name in seen:
                raise DuplicateResult(f"{name} appears twice in {assigned.client_id}'s "
                                      f"submission for round {assigned.round}; send one result "
                                      "per parameter.")
            seen.add(name)
            if tuple(result.shape) != self.shapes[name] or tuple(
                    map(tuple, result.region)) != tuple(region[name]):
                raise WrongRegion(
                    f"{name}: shape {tuple(result.shape)} region {result.region} is not this "
                    f"client's tier {assigned.tier} region {region[name]} of shape "
                    f"{self.shapes[name]}; the client trains the wrong tier or model, so it "
                    "should rejoin.")
            valid.append(_valid(result))
        wrong = [r for r in valid if r.tokens != assigned.tokens]
        if wrong:
            raise WrongTokenCount(
                f"{wrong[0].name} claims {wrong[0].tokens} tokens ({len(wrong)} result(s) "
                f"differ), but the assignment holds {assigned.tokens}; results are weighted by "
                "the tokens assigned, so send that count.")
        check_reports(assigned.tokens, loss, train_seconds)
        return self.limits.check(valid)

    def partials(self, assigned: RoundAssignment, regions: Iterable[Mapping[str, Region]],
                 results: Sequence[SparseResult], *, tokens: int, loss: float | None,
                 train_seconds: float | None) -> list[SparseResult]:
        """A relay's results as the coordinator keeps them: per parameter at most one per
        tier region (``regions``: each tier's), their tokens adding up to ``tokens`` (the
        assignment's, less the sequences it missed); or the BadResult that refuses them."""
        allowed: dict[str, set[Region]] = {}
        for tier in regions:
            for name, region in tier.items():
                allowed.setdefault(name, set()).add(tuple(map(tuple, region)))
        seen: set[tuple[str, Region]] = set()
        covered: dict[str, int] = {}
        valid: list[ValidResult] = []
        for result in results:
            name, region = result.name, tuple(map(tuple, result.region))
            if name not in self.shapes:
                raise UnknownParameter(f"{name!r} is not a parameter of this run's model; send "
                                       "canonical names (modeling.naming).")
            if tuple(result.shape) != self.shapes[name] or region not in allowed[name]:
                raise WrongRegion(f"{name}: shape {tuple(result.shape)} region {region} is no "
                                  f"tier's region of shape {self.shapes[name]}; a relay sends "
                                  "one partial per parameter and tier region.")
            if (name, region) in seen:
                raise DuplicateResult(f"{name} region {region} appears twice in "
                                      f"{assigned.client_id}'s submission for round "
                                      f"{assigned.round}; fold each region's results into one.")
            seen.add((name, region))
            valid.append(_valid(result))
            covered[name] = covered.get(name, 0) + result.tokens
        wrong = sorted(name for name, count in covered.items() if count != tokens)
        if wrong:
            raise WrongTokenCount(
                f"{wrong[0]}'s partials hold {covered[wrong[0]]} tokens ({len(wrong)} "
                f"parameter(s) differ), but the members delivered {tokens}; each parameter's "
                "partials add up to the tokens of the sequences they cover.")
        check_reports(tokens, loss, train_seconds)
        return self.limits.check(valid, partial=True)


def check_fetch(client_id: str, ids: Sequence[int], held: set[int], *, data_size: int) -> None:
    """A FetchSequences request, before any sequence is read: UnknownSequence for ids beyond
    the run's ``data_size`` sequences, NotInRound for ids outside the member's assignments
    in the rounds being collected (``held``), RepeatedSequenceIds for an id asked twice (so
    no request holds more ids than the assignment)."""
    bad = [i for i in ids if i >= data_size]
    if bad:
        raise UnknownSequence(f"sequence ids {bad[:5]} are outside the run's {data_size} "
                              "sequences; fetch the ids GetRound assigned.")
    foreign = sorted(set(ids) - held)
    if foreign:  # a member reads only the sequences it is assigned now
        raise NotInRound(f"sequence ids {foreign[:5]} are not in {client_id}'s assignment "
                         "for the round being collected (it closed, or they are another "
                         "client's); ask GetRound for the current assignment.")
    if len(set(ids)) < len(ids):
        counts = Counter(ids)
        repeated = sorted(i for i, n in counts.items() if n > 1)
        raise RepeatedSequenceIds(
            f"the request names sequence ids {repeated[:5]} more than once ({len(ids)} "
            f"ids, {len(counts)} distinct); ask for each assigned id once.")


def _valid(result: SparseResult) -> ValidResult:
    """``result`` validated (a decoded one already is), or the MalformedResult that says why
    not."""
    try:
        return validate(result)
    except CompressionError as err:
        raise MalformedResult(str(err)) from err


def check_tier_losses(losses: Iterable[tuple[int, int, float]], tiers: Iterable[int],
                      tokens: int) -> dict[int, tuple[float, int]]:
    """A relay's losses per tier, ``(tier, tokens, loss)`` each, as the record keeps them:
    tier → (loss, tokens). BadReport unless each names once, with a possible loss, one of
    ``tiers`` (those the relay's heartbeats listed a member at), and their tokens add up to
    the ``tokens`` its members delivered."""
    kept: dict[int, tuple[float, int]] = {}
    allowed = set(tiers)
    for tier, count, loss in losses:
        if tier in kept or tier not in allowed:
            why = "twice" if tier in kept else "at which the relay listed no member"
            raise BadReport(f"the losses per tier name tier {tier} {why}; report each tier "
                            "the relay's members trained once.")
        check_reports(count, loss, None)
        kept[tier] = (loss, count)
    covered = sum(count for _, count in kept.values())
    if kept and covered != tokens:
        raise BadReport(f"the losses per tier cover {covered} tokens, but the members "
                        f"delivered {tokens}; weigh each tier by the tokens of its members "
                        "that delivered.")
    return kept


MAX_RELAYED = 4096  # members a relay may list under it on the root's page
MAX_NAME = 128  # characters of a listed member's name


def check_relayed(members: Sequence[tuple[str, int, float]], relay: bool,
                  tiers: Iterable[int]) -> list[dict[str, object]]:
    """The members a relay lists under it, ``(name, tier, tokens_per_second)`` each, as the
    status keeps them. BadReport unless the sender is a relay and each entry names a member
    once, at a tier the run allows, with a possible speed; at most MAX_RELAYED."""
    if members and not relay:
        raise BadReport("only a relay lists members behind it; a member's heartbeat carries "
                        "none.")
    if len(members) > MAX_RELAYED:
        raise BadReport(f"{len(members)} members listed behind a relay; at most "
                        f"{MAX_RELAYED}.")
    allowed, seen, kept = set(tiers), set(), []
    for name, tier, speed in members:
        if not name or len(name) > MAX_NAME or name in seen or tier not in allowed or not (
                math.isfinite(speed) and speed >= 0):
            raise BadReport(f"the member {name[:MAX_NAME]!r} listed behind the relay (tier "
                            f"{tier}, {speed} tokens/s) is not one the run can have: a name "
                            f"of 1 to {MAX_NAME} characters, once, an allowed tier, a finite "
                            "speed.")
        seen.add(name)
        kept.append({"name": name, "tier": tier, "tokens_per_second": speed})
    return kept


def check_reports(tokens: int, loss: float | None, train_seconds: float | None) -> None:
    """BadResult unless what a client says of its work is physically possible: speed and
    loss feed the next round's split and the record. (Its results' tokens are the
    coordinator's own count, checked apart: a claimed count could steer the whole update.)
    A loss or time that is not a number is refused, whichever way it arrived."""
    if loss is not None and not (math.isfinite(loss) and 0.0 <= loss <= MAX_LOSS):
        raise BadReport(f"the reported loss {loss} is not in 0..{MAX_LOSS:g}; the client "
                        "diverged, so it should reload the checkpoint.")
    if train_seconds is not None and (
            not math.isfinite(train_seconds) or train_seconds < 0
            or (train_seconds > 0 and tokens / train_seconds > MAX_TOKENS_PER_SECOND)):
        raise BadReport(f"train_seconds {train_seconds} for {tokens} tokens is not a time a "
                        f"machine can take (at most {MAX_TOKENS_PER_SECOND:g} tokens/s); "
                        "report the seconds the training took.")
