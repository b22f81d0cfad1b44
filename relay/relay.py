"""The relay's state: its members, the root's rounds it holds, and how each round's work is
split, collected and folded into one submission upstream (docs/architecture.md, "Relays").

    relay = Relay(root, member_token=token, deadline_s=45.0, folder=Path("runs/relay"))
    relay.start()                          # joins the root, learns the model, starts threads
    CoordinatorService(relay, limits)      # its members' service: the root's own servicer
    relay.stop("done")

The relay offers its members the run's member API (server/member_api.py), as the root's
coordinator does, over its upstream (``relay.upstream``, its transport edge to the root):
nothing here touches a message or a status code.

Per root round: ask the root for work (GetRound), fetch its sequences once, split them among
the live members by speed (the root's own ``assign``), collect each member's results through
the root's own gate (``SubmissionGate``, for the member's tier), and once every member has
answered, left, fallen silent or ``deadline_s`` passed, submit one partial sum per parameter
and tier region with the sequences nobody delivered named as missed: the root puts them back
in its queue. Nothing is submitted when no member delivered; the root then drops the relay
from the round at its deadline, as it drops a member.

With ``[round] overlap`` the root hands its members the next rounds' work before a round
closes, and so does the relay: it holds as many root rounds as the root keeps open
(``server.pipeline.WINDOW``), each split on its own, and a member that delivers one part
finds its next in the answer. Rounds are handed in oldest first, each once it is done, and
each held round's deadline comes ``deadline_s`` after the one before it, as the root's do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import posixpath
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from torch import Tensor

from matformer.client.mirror import MirrorFirst
from matformer.modeling.atomic import write_json_atomic
from matformer.modeling.checkpoint.files import read_json
from matformer.modeling.checkpoint.hf_config import from_config_dict
from matformer.modeling.checkpoint.manifest import Manifest
from matformer.modeling.checkpoint.remote_code import consented, listed_modules, packed_modules
from matformer.modeling.compression import (
    SparseResult,
    tier_regions,
    universal_config,
    universal_shapes,
)
from matformer.modeling.compression.partial import Recompressor, partial_sums
from matformer.modeling.config import ModelConfig
from matformer.modeling.errors import MatformerError
from matformer.protocol.auth import SessionTokens, tokens_equal
from matformer.protocol.files import send_file
from matformer.protocol.records import ServedCheckpoint, SubmitHeader, TierLoss
from matformer.protocol.sparse import ResultLayouts
from matformer.relay.cache import FileCache, UpdateCache
from matformer.relay.rounds import HeldRound, Part, RelayMember
from matformer.relay.upstream import Upstream, rounds_of
from matformer.server.errors import (
    AlreadySubmitted,
    JoinRefused,
    NotInRound,
    SessionInvalid,
    StaleAssignment,
    StaleRound,
    UnknownClient,
    UpstreamError,
    WrongJoinToken,
)
from matformer.server.gate import MAX_RELAYED, SubmissionGate
from matformer.server.joins import JoinGate
from matformer.server.limits import SubmissionLimits, clip_to_peers
from matformer.server.member_api import Expected, JoinAsk, Joined, Waiting
from matformer.server.pipeline import WINDOW, trusted_speeds
from matformer.server.rounds import RoundAssignment, deadline_after, pulled_in
from matformer.server.sections import FaultsSection
from matformer.server.tiers import (
    MAX_TOKENS_PER_SECOND,
    Capabilities,
    TierAssignment,
    TierPolicy,
    check_speed,
)
from matformer.server.work import assign

WAIT_S = 0.5  # between looks at the root when it has no work for the relay
RETRY_AFTER_S = 0.25  # a member with no part in a held round asks again after this
MEMBER_TIMEOUT_S = 30.0  # a member silent this long is gone: its part counts as missed
SUMMARY_FILE = "summary.json"  # in the relay's --dir, written when it stops
# A relay's members get this share of the run's [round] deadline_s unless --deadline-s says:
# the rest is the relay's to fold their results and hand them in
DEADLINE_SHARE = 0.75
DEFAULT_DEADLINE_S = 45.0  # ... under a root too old to say its deadline


class RelayError(MatformerError):
    """The relay cannot serve the run as the root runs it."""


class Relay:
    def __init__(self, root: Upstream, *, member_token: str, deadline_s: float | None,
                 folder: Path, topk: int = 0, trust_remote_code: bool = False,
                 faults: FaultsSection | None = None,
                 mirror: str | None = None, log: Callable[[str], None] = lambda line: None,
                 member_timeout_s: float = MEMBER_TIMEOUT_S, min_members: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.root = root
        self.member_token = member_token  # what the relay's members present to join
        # the code a root's checkpoint names runs only with the operator's consent
        self.trust_remote_code = trust_remote_code
        # its members' admission, as the root's ([faults] max_members, max_joins_per_minute)
        self.faults = faults or FaultsSection()
        self.folder = folder
        self.deadline_s = deadline_s  # None: DEADLINE_SHARE of the run's, learnt at start
        self.root_deadline_s = 0.0  # the run's [round] deadline_s, learnt at start
        # 0: the members' exact sum; else cut to topk per chunk, the rest carried (lossy)
        self.recompress = Recompressor(topk) if topk else None
        self.member_timeout_s = member_timeout_s
        # members ready before the relay takes its first round: it reports no speed till then,
        # so the root hands it no work, and the first to join does not get the first rounds
        self.min_members = min_members
        self.started = False  # a round taken: min_members no longer holds anything back
        self.log = log
        self.clock = clock
        source = MirrorFirst(mirror, log)  # the broadcast from a cache of the root's, first
        self.updates = UpdateCache(root, source, closed=lambda: self.root_round)
        self.files = FileCache(root, folder / "checkpoints", source)
        self.sessions = SessionTokens()
        self.members: dict[str, RelayMember] = {}
        self.held: list[HeldRound] = []  # the root's rounds this relay collects, oldest first
        self.window = 1  # rounds held at once: the root's window (overlap), learnt at start
        self.peer_clip = 0.0  # the root's [faults] peer_clip, learnt at start
        self.finished = False
        self.root_round = 0  # the rounds the root has closed, as its last answer said
        self.run_tokens = 0  # ... and the tokens its completed rounds trained
        self.rounds_submitted = 0
        self.joined: Joined | None = None  # the root's answer to the relay's join
        self._next_id = 0
        self._joins = JoinGate(self.faults, clock())
        self._retry_s = WAIT_S  # until the root's next answer: when it said to ask again
        self._owed: dict[str, float] = {}  # ids rounding left each member short: assign's
        self._changed = threading.Condition()  # guards everything above
        self._stopping = threading.Event()
        self._speed_changed = threading.Event()  # heartbeat the root now, not on schedule
        self._threads: list[threading.Thread] = []

    # -- the relay's life --------------------------------------------------------------------

    def start(self) -> None:
        """Join the root, learn the run's model from its latest checkpoint, and start the
        heartbeat and round threads."""
        self.joined = self.root.join(tokens_per_second=0.0)
        settings = self.joined.settings
        self.root_deadline_s = settings.deadline_s  # 0: an older root that does not say
        if self.deadline_s is None:
            self.deadline_s = (settings.deadline_s or DEFAULT_DEADLINE_S / DEADLINE_SHARE) \
                * DEADLINE_SHARE
        elif settings.deadline_s and self.deadline_s > settings.deadline_s:
            with contextlib.suppress(UpstreamError):
                self.root.leave("its deadline is longer than the run's")
            self.root.close()
            raise RelayError(
                f"--deadline-s {self.deadline_s:g} is longer than the run's [round] deadline_s "
                f"{settings.deadline_s:g}: the root would close rounds while this relay's "
                f"members still train them; give at most {settings.deadline_s:g}, or leave it "
                f"out ({DEADLINE_SHARE:.0%} of the run's).")
        self.heartbeat_s = settings.heartbeat_s or 5.0
        self.window = WINDOW if settings.overlap else 1
        manifest_path = self.root.checkpoint().manifest_path
        folder = manifest_path.rpartition("/")[0]
        manifest = Manifest.from_dict(read_json(self.files.path(manifest_path)))
        universal = manifest.entry(0)
        config_file = next((f for f in [*(universal.files if universal else []),
                                        *manifest.common_files]
                            if f.rpartition("/")[2] == "config.json"), None)
        if config_file is None:
            raise RelayError(f"the root's checkpoint {folder} lists no universal config.json; "
                             "a relay learns the run's model from it (export the tiers "
                             "with this Matformer).")
        config = universal_config(self._model_config(folder, config_file))
        shapes = universal_shapes(config)
        ids = settings.tier_ids()  # the run's Mix'n'Match slices, by their ids
        tiers = [*sorted(e.tier for e in manifest.tiers if not e.is_mix), *ids.ids()]
        self.policy = TierPolicy(config, allowed=tiers, pins={}, mix={}, tier_ids=ids)
        self.regions = {t: tier_regions(shapes, config, ids.resolve(t)) for t in tiers}
        self.layouts = ResultLayouts(settings.compression.build(), shapes,
                                     self.regions.__getitem__, tiers)
        # the root's own gate and limits ([faults] max_norm, norm_action) for each member,
        # and its peer clip over the members' results before they are folded
        self.peer_clip = settings.peer_clip
        self.gate = SubmissionGate(shapes, SubmissionLimits(settings.compression, FaultsSection(
            max_norm=settings.max_norm, norm_action=settings.norm_action)))
        self.log(f"joined the root at {self.root.address} as {self.root.client_id}; serving "
                 f"tiers {', '.join(map(str, tiers))}")
        for target in (self._beat, self._rounds):
            thread = threading.Thread(target=target, daemon=True, name=target.__name__)
            thread.start()
            self._threads.append(thread)

    def _model_config(self, folder: str, config_file: str) -> ModelConfig:
        """The run's model config from the root's checkpoint. Module files it names are made
        paths inside this relay's copy of the checkpoint (never the working folder) and run
        only with ``trust_remote_code``, downloaded once allowed (the root serves only files
        its manifest vouches for)."""
        path = self.files.path(f"{folder}/{config_file}")
        config = consented(packed_modules(from_config_dict(read_json(path)), path.parent),
                           self.trust_remote_code, f"the root's checkpoint {folder}")
        inside = posixpath.dirname(f"{folder}/{config_file}")
        for module in listed_modules(config):
            self.files.path(f"{inside}/{module.name}")
        return config

    def stop(self, reason: str) -> None:
        self._stopping.set()
        self._speed_changed.set()
        with self._changed:
            self._changed.notify_all()
        for thread in self._threads:
            thread.join(timeout=30)
        with contextlib.suppress(UpstreamError):  # a courtesy: the root drops silent members
            self.root.leave(reason)
        self.root.close()
        # what the root saw of this relay, kept once it left (the root forgets a member that
        # leaves): every message each way, framed, and the rounds it handed in
        self.folder.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.folder / SUMMARY_FILE, {
            "name": self.root.name, "client_id": self.root.client_id, "reason": reason,
            "bytes_up": self.root.bytes_up, "bytes_down": self.root.bytes_down,
            "rounds_submitted": self.rounds_submitted})

    # -- members ---------------------------------------------------------------------------

    def admit(self, ask: JoinAsk) -> Joined:
        """A member's Join: the relay's member token, a member (not another relay) of the
        run's model; then ``join``."""
        if not tokens_equal(ask.join_token, self.member_token):
            raise WrongJoinToken("wrong join token; ask the run's operator for it "
                                 "(--join-token).")
        if ask.capabilities.relay:
            raise JoinRefused("a relay joins the root, not another relay; give it the root's "
                              "address as --upstream.")
        joined = self._joined()
        if ask.schema_hash is not None and ask.schema_hash != joined.schema_hash:
            raise JoinRefused(f"the client's model has canonical schema hash "
                              f"{ask.schema_hash or '(none)'}, the run's model "
                              f"{joined.schema_hash}; load the run's checkpoint "
                              "(--checkpoint server).")
        member, tier, token = self.join(ask.capabilities)
        return dataclasses.replace(joined, client_id=member.client_id, session_token=token,
                                   tier=tier, round=self.root_round)

    def authenticate(self, token: str) -> str:
        client_id = self.sessions.client_of(token)
        if client_id is None:
            raise SessionInvalid("unknown or revoked session token; call Join again.")
        return client_id

    def heartbeat(self, client_id: str, *, tokens_per_second: float | None = None,
                  relayed: Sequence[tuple[str, int, float]] = ()) -> RelayMember:
        """A member alive, at a speed the root would take from it (BadCapabilities else)."""
        if tokens_per_second is not None:
            check_speed(tokens_per_second, client_id)
        return self.seen(client_id, tokens_per_second)

    def closed_rounds(self) -> int:
        return self.root_round

    @property
    def sequence_length(self) -> int:
        return self._joined().settings.sequence_length

    def _joined(self) -> Joined:
        if self.joined is None:
            raise RelayError("the relay serves members only once it has joined the root "
                             "(Relay.start).")
        return self.joined

    def join(self, capabilities: Capabilities) -> tuple[RelayMember, TierAssignment, str]:
        """A member of this relay: its tier by the root's own rule (its memory and request),
        and its session. Raises the policy's ``TierAssignmentError``."""
        tier = self.policy.assign(capabilities)
        with self._changed:
            self._joins.admit(len(self.members), self.clock())
            client_id = f"{self.root.client_id}.m{self._next_id}"
            self._next_id += 1
            member = RelayMember(client_id=client_id, name=capabilities.name, tier=tier.tier,
                                 tokens_per_second=capabilities.tokens_per_second,
                                 last_seen=self.clock())
            self.members[client_id] = member
            self.log(f"{member.name} joined as {client_id} at tier {tier.tier}")
            self._speed_changed.set()
            return member, tier, self.sessions.issue(client_id)

    def seen(self, client_id: str, tokens_per_second: float | None = None) -> RelayMember:
        with self._changed:
            member = self.members.get(client_id)
            if member is None:
                raise UnknownClient(f"{client_id} left this relay; call Join again.")
            member.last_seen = self.clock()
            if (tokens_per_second is not None and not member.measured_by_round
                    and tokens_per_second != member.tokens_per_second):  # a claim, as at the root
                member.tokens_per_second = tokens_per_second
                self._speed_changed.set()
            return member

    def leave(self, client_id: str, reason: str = "") -> None:
        with self._changed:
            self.members.pop(client_id, None)
            self.sessions.revoke(client_id)
            for held in self.held:
                if client_id in held.parts:
                    held.missed.add(client_id)
            self._changed.notify_all()

    def work(self, client_id: str, after: int | None = None) -> RoundAssignment | Waiting:
        """The member's oldest part not yet delivered (after ``after``); else when to ask
        again, or that the root's run is over. Counts as a heartbeat."""
        self.seen(client_id)
        if self.finished:  # the root's round: a member catches up to it before it ends
            return Waiting(round=self.root_round, run_tokens=self.run_tokens, finished=True)
        part = self.assignment_for(client_id, after)
        if part is None:
            return Waiting(round=self.root_round, run_tokens=self.run_tokens,
                           retry_after_s=RETRY_AFTER_S)
        return part

    def wait_for_members(self, timeout_s: float) -> bool:
        """Until every member left (they leave once told the run finished), at most
        ``timeout_s``; whether they did."""
        with self._changed:
            return self._changed.wait_for(lambda: not self.members, timeout_s)

    def speed(self) -> float:
        """What the relay reports to the root: its ready members' tokens/s together (0 until
        ``min_members`` are ready, before its first round), at most the fastest speed the
        root takes."""
        ready = self._ready()
        if not self.started and len(ready) < self.min_members:
            return 0.0
        return min(sum(m.tokens_per_second for m in ready), MAX_TOKENS_PER_SECOND)

    def _ready(self) -> list[RelayMember]:
        """The live members with a speed to size a share by."""
        now = self.clock()
        with self._changed:
            return [m for m in self.members.values()
                    if now - m.last_seen <= self.member_timeout_s and m.tokens_per_second > 0]

    # -- a member's round ------------------------------------------------------------------

    def assignment_for(self, client_id: str, after: int | None) -> RoundAssignment | None:
        """The member's oldest part not yet delivered (in a round after ``after``)."""
        pending = self.pending(client_id, after)
        return pending[0] if pending else None

    def pending(self, client_id: str, after: int | None = None) -> list[RoundAssignment]:
        """The member's parts not yet delivered, oldest first (in rounds after ``after``)."""
        with self._changed:
            parts = [held.parts.get(client_id) for held in self.held
                     if after is None or held.work.round > after]
            return [p.assignment for p in parts if p is not None and p.results is None]

    def sequences(self, client_id: str, ids: Sequence[int]) -> Iterator[tuple[int, Tensor]]:
        with self._changed:
            for held in self.held:
                part = held.parts.get(client_id)
                if part is not None and set(ids) <= set(part.assignment.sequence_ids):
                    return iter([(i, held.sequences[i]) for i in ids])
            raise NotInRound(f"sequence ids {list(ids)[:5]} are not in {client_id}'s part of "
                             "a round this relay holds; ask GetRound again.")

    def part_of(self, client_id: str, round_index: int, assignment_id: str) -> Part:
        """The member's part that a submission's header names. Raises StaleRound,
        NotInRound, StaleAssignment or AlreadySubmitted, as the root does."""
        with self._changed:
            held = next((h for h in self.held if h.work.round == round_index), None)
            if held is None:
                raise StaleRound(f"results for round {round_index}, which this relay no "
                                 "longer collects; drop them and fetch the current assignment.")
            part = held.parts.get(client_id)
            if part is None:
                raise NotInRound(f"{client_id} has no part in round {round_index}; wait for "
                                 "the next round.")
            if assignment_id != part.assignment.assignment_id:
                raise StaleAssignment(f"results for {assignment_id!r}, but {client_id}'s part "
                                      f"is {part.assignment.assignment_id!r}.")
            if part.results is not None:
                raise AlreadySubmitted(f"{client_id} already submitted for round "
                                       f"{round_index}.")
            if self.clock() >= held.deadline:
                raise StaleRound(f"round {round_index} is past this relay's deadline; drop "
                                 "its results.")
            return part

    def expects(self, client_id: str, header: SubmitHeader) -> Expected:
        part = self.part_of(client_id, header.round, header.assignment_id)
        return Expected(part.assignment, self.layouts.of(part.assignment.tier))

    def submit_results(self, client_id: str, header: SubmitHeader,
                       results: Sequence[SparseResult], *, wire_bytes: int = 0) -> None:
        """Keep a member's results once the root's gate passes them for its tier."""
        part = self.part_of(client_id, header.round, header.assignment_id)
        kept = self.gate.results(part.assignment, self.regions[part.assignment.tier],
                                 results, loss=header.loss, train_seconds=header.train_seconds)
        with self._changed:
            self.part_of(client_id, header.round, header.assignment_id)  # still open
            part.results, part.loss, part.delivered_at = kept, header.loss, self.clock()
            member = self.members.get(client_id)
            if member is not None:
                member.missed = 0
                if header.train_seconds > 0:  # the speed it showed
                    member.tokens_per_second = part.assignment.tokens / header.train_seconds
                    member.measured_by_round = True
            self._changed.notify_all()

    def rejected(self, client_id: str, error: Exception) -> str:
        """A refused submission: the relay counts none (its members answer to the root's
        rules through it); nothing to add to the refusal."""
        return ""

    def max_submission_bytes(self) -> int:
        return FaultsSection().max_submission_bytes  # the root's default: the relay's peers

    # -- catching up ---------------------------------------------------------------------

    def update_rounds(self, client_id: str, since_round: int, tier: int | None = None,
                      wait_s: float = 0.0) -> Iterator[list[Any]]:
        """The root's rounds from ``since_round`` on at ``tier`` (default the member's), from
        the cache or fetched once; the root's refusal is passed on (UpstreamError)."""
        member = self.seen(client_id)
        messages = self.updates.messages(since_round, member.tier if tier is None else tier,
                                         wait_s)
        return iter([round_messages for _, round_messages in rounds_of(messages)])

    def checkpoint(self, client_id: str) -> ServedCheckpoint:
        return self.root.checkpoint()

    def checkpoint_chunks(self, path: str) -> Iterator[Any]:
        """A file of the root's checkpoint, from this relay's copy (fetched once)."""
        return send_file(self.files.path(path))

    def downloaded(self, client_id: str, nbytes: int, *, rounds: int = 0) -> None:
        """What a member took: the relay counts only what crosses to the root."""

    # -- threads ---------------------------------------------------------------------------

    def _beat(self) -> None:
        """Heartbeat the root on schedule, and at once when the members' speed changes (a
        relay of no members gets no work until it reports one)."""
        while not self._stopping.is_set():
            self._speed_changed.wait(self.heartbeat_s)
            self._speed_changed.clear()
            if self._stopping.is_set():
                return
            try:
                held = self.held[:1]
                with self._changed:  # what its members are now, for the root's page: each
                    # name once, as the root takes a listing (members may share a name here)
                    listed = list({m.name: (m.name, m.tier, m.tokens_per_second)
                                   for m in self.members.values()}.values())[:MAX_RELAYED]
                closed = self.root.heartbeat(held[0].work.round if held else self.root_round,
                                             self.speed(), listed)
                self.root_round = max(self.root_round, closed)
            except UpstreamError as err:
                self.log(f"heartbeat to the root failed: {err.code.name}")

    def _rounds(self) -> None:
        """Hand in the oldest held round once it is done; take the root's next round while
        fewer than ``window`` are held; else wait for either."""
        asked = -math.inf  # when the root was last asked for a round and had none
        while not self._stopping.is_set() and not self.finished:
            try:
                with self._changed:
                    self._mark_silent()
                    due = bool(self.held) and self.held[0].done(self.clock())
                    room = len(self.held) < self.window
                if due:
                    self._hand_in()
                    continue
                if room and self.clock() - asked >= self._retry_s:
                    if self._take_round():
                        continue
                    asked = self.clock()
                with self._changed:
                    wait_s = self._retry_s if room else 1.0
                    if self.held:
                        wait_s = min(wait_s, max(0.0, self.held[0].deadline - self.clock()))
                    self._changed.wait(min(wait_s, 1.0))
            except UpstreamError as err:
                self.log(f"the root answered {err.code.name}: {err.details}")
                self._stopping.wait(WAIT_S)

    def _take_round(self) -> bool:
        """Ask the root for its next round of work (after those held) and split it among the
        live members; whether one more round is now held."""
        with self._changed:
            after = self.held[-1].work.round if self.held else None
        work = self.root.get_round(after)
        self.run_tokens = work.run_tokens
        if work.state != "train":  # the rounds it closed ("train": the work's round)
            self.root_round = max(self.root_round, work.round)
        self._retry_s = min(max(work.retry_after_s, 0.05), WAIT_S)
        if work.state == "finished":
            with self._changed:
                self.finished = True
                self._changed.notify_all()
            return False
        if work.state != "train":
            return False
        live = self._ready()
        if not live or (not self.started and len(live) < self.min_members):
            return False
        sequences = self.root.fetch(list(dict.fromkeys(work.sequence_ids)))
        # the root's rule: a claimed speed counts up to a typical one until a part shows it
        shares = assign(list(work.sequence_ids), trusted_speeds(live), self._owed)
        received = self.clock()
        with self._changed:  # the root's rule, and never past the root's own deadline
            deadline = deadline_after(received, [h.deadline for h in self.held],
                                      self.deadline_s)
            if work.deadline_in_s > 0:  # less the time the root left for handing in
                margin = max(self.root_deadline_s - self.deadline_s, 0.0)
                deadline = min(deadline, received + work.deadline_in_s - margin)
        tiers = {m.client_id: m.tier for m in live}
        parts = {client: Part(assignment=RoundAssignment(
            round=work.round, client_id=client, tier=tiers[client],
            sequence_ids=tuple(int(i) for i in ids),
            tokens=sum(int(sequences[int(i)].shape[0]) for i in ids), deadline=deadline,
            assignment_id=f"{work.assignment_id}/{client}"))
            for client, ids in shares.items() if len(ids)}
        with self._changed:
            self.started = True
            self.held.append(HeldRound(work=work, sequences=sequences, parts=parts,
                                       opened=self.clock(), deadline=deadline))
            self._changed.notify_all()
        return True

    def _pull_in(self, held: HeldRound, now: float) -> None:
        """(lock held) The root's rule for the round behind one that ended (``pulled_in``)."""
        deadline = pulled_in(held.deadline, now, self.deadline_s)
        if deadline < held.deadline:
            held.deadline = deadline
            for part in held.parts.values():
                part.assignment = dataclasses.replace(part.assignment, deadline=deadline)

    def _mark_silent(self) -> None:
        """(lock held) Members of a held round silent past ``member_timeout_s``: missed."""
        now = self.clock()
        for held in self.held:
            for client, part in held.parts.items():
                member = self.members.get(client)
                if part.results is None and (
                        member is None or now - member.last_seen > self.member_timeout_s):
                    held.missed.add(client)

    def _hand_in(self) -> None:
        """Submit the oldest held round's partial sums upstream, naming what nobody
        delivered."""
        with self._changed:
            held = self.held.pop(0)
            if self.held:  # its members are free for the next round now: pulled in
                self._pull_in(self.held[0], self.clock())
            self._changed.notify_all()
        delivered = [p for p in held.parts.values() if p.results is not None]
        missed = [i for p in held.parts.values() if p.results is None
                  for i in p.assignment.sequence_ids]
        with self._changed:
            for client, part in held.parts.items():
                member = self.members.get(client)
                if member is not None and part.results is None:
                    member.missed += 1
        if not delivered:
            self.log(f"round {held.work.round}: no member delivered; the root takes its "
                     "sequences back at its deadline")
            return
        by_name: dict[str, list[SparseResult]] = {}
        for part in delivered:
            for result in part.results:
                by_name.setdefault(result.name, []).append(result)
        partials = [p for results in by_name.values()
                    for p in partial_sums(clip_to_peers(results, self.peer_clip))]
        if self.recompress is not None:
            partials = [self.recompress(p) for p in partials]
        tokens = sum(p.assignment.tokens for p in delivered)
        by_tier: dict[int, list[Part]] = {}
        for part in delivered:
            if part.assignment.tokens:
                by_tier.setdefault(part.assignment.tier, []).append(part)
        header = SubmitHeader(
            round=held.work.round, client_id=self.root.client_id, tokens=tokens,
            loss=_weighted_loss(delivered),
            train_seconds=max(p.delivered_at for p in delivered) - held.opened,
            assignment_id=held.work.assignment_id, missed_ids=tuple(missed),
            tier_losses=tuple(TierLoss(tier=tier, tokens=sum(p.assignment.tokens for p in parts),
                                       loss=_weighted_loss(parts))
                              for tier, parts in sorted(by_tier.items())))
        self.root.submit(header, partials)
        self.rounds_submitted += 1
        self.log(f"round {held.work.round}: {len(delivered)} of {len(held.parts)} members, "
                 f"{tokens:,} tokens, {len(partials)} partials upstream"
                 + (f"; {len(missed)} sequences missed" if missed else ""))


def _weighted_loss(parts: list[Part]) -> float:
    """The members' mean loss, weighted by the tokens each delivered."""
    return sum(p.loss * p.assignment.tokens for p in parts) / sum(
        p.assignment.tokens for p in parts)

