"""`matformer-client train --server HOST:PORT`: one participant of a federated run.

    summary = FederatedClient(FederatedOptions(server="127.0.0.1:7070", tier=1)).run()

1. Probe the device (kind, name, memory) and join with the run's join token. The coordinator
   assigns the tier, says why, and names its latest checkpoint.
2. Load that checkpoint for the tier (``client.checkpoints``: through its manifest, from the
   coordinator, a ``--checkpoint`` copy or, with updates too, a ``--mirror`` (``client.mirror``);
   checked against the run's schema hash), measure tokens/s at the tier on a short warm-up and
   report it (the coordinator sizes this client's share by it), then replay the logged updates.
3. Each round: fetch the assigned sequences (``client.data``: from the coordinator, or a
   local MDAT whose fingerprint matches), accumulate gradients at the tier(s) and compress
   them with error feedback (``client.local_round``), submit; then apply the broadcast
   updates and compare the replica's weight hash with the coordinator's. The error-feedback
   momentum is saved after every accepted round, so a restarted client keeps the gradient it
   has not sent yet.

Catching up is one loop (``catch_up``): replay the log; when the log no longer reaches back
or a hash disagrees, load the latest checkpoint and replay once more; a second disagreement
is damage, not drift (``ReplicaDiverged``). The coordinator's answers arrive as the domain
errors of ``client.errors`` (``RoundOver``, ``SessionEnded``, ...), never as status codes.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from matformer.client.checkpoints import load_replica, open_mirror
from matformer.client.connection import Connection, Membership, PublishedCheckpoint, Train
from matformer.client.data import SequenceSource
from matformer.client.errors import (
    ClientError,
    FeedbackStateMismatch,
    NameTaken,
    ReplicaDiverged,
    RoundOver,
    SessionEnded,
    Terminated,
    UpdatesPruned,
)
from matformer.client.local_round import Advance, LocalRound, LocalSteps, RoundSetup, RoundWork
from matformer.client.mirror import Broadcast
from matformer.client.node import Node
from matformer.client.probe import device_name, measure_tokens_per_second, memory_bytes
from matformer.client.progress import Progress
from matformer.client.replica import Replica
from matformer.client.rounds import OverlappedRounds, SynchronousRounds
from matformer.client.state_dir import feedback_path, held, previous_session, save_session
from matformer.client.summary import ClientSummary, Cost, write_summary
from matformer.modeling.checkpoint.loader import STRATEGIES
from matformer.modeling.compression import (
    DENSE_BYTES_PER_VALUE,
    RoundUpdate,
    region_shape,
    tier_regions,
)
from matformer.modeling.devices import compile_model, resolve_device
from matformer.modeling.distributed import DataParallel
from matformer.modeling.matformer import Tier, tier_label

JOIN_TOKEN_ENV = "MATFORMER_JOIN_TOKEN"
NAME_PATIENCE_S = 90.0  # how long a Join waits for its name to be freed (ALREADY_EXISTS)
NAME_RETRY_S = 5.0
MAX_REJOINS = 3  # joins in a row after the coordinator forgot this client's session


@dataclass(kw_only=True)
class FederatedOptions:
    server: str  # HOST:PORT of the coordinator's gRPC service
    tier: int | None = None  # the smallest tier index (largest model) wanted; None: any
    load_strategy: str = "auto"  # auto | sliced | universal
    checkpoint: str = "server"  # server | a folder | hf:ORG/NAME holding the run's checkpoints
    mirror: str | None = None  # base URL of an HTTP mirror of the broadcast (client/mirror.py)
    trust_remote_code: bool = False  # run module files the run's checkpoint carries
    data: Path | None = None  # a local copy of the run's MDAT; None: sequences from the server
    device: str = "cpu"  # cpu | cuda | cuda:N | mps (under torchrun: each rank's local GPU)
    precision: str = "fp32"  # fp32 | bf16 | fp16 (autocast; float32 weights and results)
    batching: str = "packed"  # packed rows of the run's sequence length | padded
    compile: bool = False  # torch.compile the replica's model
    threads: int | None = None  # CPU threads torch computes with (recorded in the summary)
    join_token: str | None = None  # None: $MATFORMER_JOIN_TOKEN
    name: str = field(default_factory=socket.gethostname)
    run_id: str = ""  # when set, the coordinator refuses to admit the client to another run
    state_dir: Path | None = None  # cache and error feedback; None: runs/clients/<name>
    tls_ca: Path | None = None  # PEM certificate to trust; None: plaintext
    microbatch_tokens: int = 2048  # padded tokens per forward/backward pass (shrinks on OOM)
    microbatch_examples: int = 64  # rows per forward/backward pass (shrinks on OOM)
    pad_to_multiple_of: int = 1  # each row padded to a multiple of this many tokens
    also_train: tuple[int, ...] = ()  # smaller nested tiers trained in the same step
    latency_ms: float = 0.0  # added before every call: local-testnet's simulated WAN
    bandwidth_mbit: float = 0.0  # each way, on every message (protocol/link.py); 0: none
    compute_speed: float = 1.0  # < 1: a slower machine (local-testnet's --client-speeds)
    busy_s: float = 0.0  # > 0: at compute_speed only every other busy_s seconds (a busy machine)
    max_rounds: int | None = None  # leave after training this many rounds; None: until the end
    progress: bool | None = None  # a progress bar; None: when stderr is a terminal


def speed_at(compute_speed: float, busy_s: float, elapsed_s: float) -> float:
    """The fraction of its machine's speed a client computes at ``elapsed_s`` after its start:
    ``compute_speed``, or with ``busy_s`` only in the busy half of each period (the first
    ``busy_s`` seconds, then every other ``busy_s``), full speed in the other."""
    if busy_s > 0 and elapsed_s // busy_s % 2 == 1:
        return 1.0
    return compute_speed


class FederatedClient:
    def __init__(self, options: FederatedOptions, log: Callable[[str], None] | None = None,
                 parallel: DataParallel | None = None) -> None:
        """``parallel``: this process is rank 0 of a data-parallel participant whose other
        ranks run ``client.node.follow``."""
        if options.load_strategy not in STRATEGIES:
            raise ClientError(f"--load-strategy {options.load_strategy!r} is not one of "
                              f"{', '.join(STRATEGIES)}.")
        self.options = options
        self.log = log or (lambda line: print(line, flush=True))
        self.device = parallel.device if parallel else resolve_device(options.device)
        self.node = Node(parallel)
        self.state_dir = options.state_dir or Path("runs/clients") / options.name
        self.mirror = open_mirror(options.checkpoint)
        self.connection = Connection(options.server, tls_ca=options.tls_ca,
                                     latency_s=options.latency_ms / 1000,
                                     bandwidth_mbit=options.bandwidth_mbit, log=self.log)
        self.broadcast = Broadcast(self.connection, options.mirror, self.log)  # updates, files
        self.member: Membership | None = None  # who this client is in the run, once joined
        self.summary: ClientSummary | None = None
        self.replica: Replica | None = None
        self.applied = 0  # the replica holds the weights after this many rounds
        self.local_round: LocalRound | None = None
        self.sequences: SequenceSource | None = None
        self.cost = Cost()
        self.started = time.monotonic()  # the clock ``busy_s`` counts its periods by

    @property
    def tier(self) -> int:
        """The tier id the coordinator assigned (an integer tier, or a Mix'n'Match slice's
        id: ``[tiers] layer_mixes``)."""
        return self.summary.tier

    @property
    def named(self) -> Tier:
        """What the tier id stands for: the integer tier, or one tier per layer."""
        return self.member.settings.tier_ids().resolve(self.tier)

    # -- the run ------------------------------------------------------------------------

    def run(self) -> ClientSummary:
        """Join, catch up, train rounds until the run finishes (or ``max_rounds``), leave.
        Ctrl-C leaves the run before it propagates; the state folder is held meanwhile."""
        with held(self.state_dir, self.options.name):
            try:
                self.join()
                self._rounds_rejoining()
            except KeyboardInterrupt as stop:
                self.leave("stopped (SIGTERM)" if isinstance(stop, Terminated)
                            else "interrupted (Ctrl-C)")
                raise
            except Exception as err:
                # hand the round's sequences back now rather than at the deadline
                self.leave(f"failed: {err}"[:500])
                raise
            finally:
                self._stop_followers()
                self._write_summary()
            self.leave("finished" if self.summary.finished else "done")
        return self.summary

    def _stop_followers(self) -> None:
        """The other ranks leave their loop; every rank's replica hash goes in the summary."""
        own = self.replica.hash() if self.replica is not None else ""
        hashes = self.node.stop(own)
        if self.summary is not None:
            self.summary.world_size = self.node.world_size
            self.summary.rank_hashes = hashes

    def _device_name(self) -> str:
        name = device_name(self.device)
        return name if self.node.world_size == 1 else f"{self.node.world_size} x {name}"

    def _rounds_rejoining(self) -> None:
        """Train rounds; when the coordinator no longer knows the session (it expired while
        this machine slept, or the coordinator lost it), join again and go on."""
        for rejoins in range(MAX_REJOINS + 1):
            try:
                return self._train_rounds()
            except SessionEnded as err:
                if rejoins == MAX_REJOINS:
                    raise
                self.log(f"the coordinator ended this client's session ({err.details}); "
                         "joining again")
                previous = self.summary
                self.join()
                self.summary.rejoins = previous.rejoins + 1
                self.summary.rounds_trained += previous.rounds_trained
                self.summary.bytes_sent += previous.bytes_sent
                self.summary.losses[:0] = previous.losses

    def join(self) -> None:
        o = self.options
        give_up = time.monotonic() + NAME_PATIENCE_S
        while True:
            try:
                member = self.connection.join(
                    name=o.name, run_id=o.run_id, tier=o.tier,
                    join_token=o.join_token if o.join_token is not None
                    else os.environ.get(JOIN_TOKEN_ENV, ""),
                    device_kind=self.device.type, device_name=self._device_name(),
                    memory_bytes=self.node.memory(memory_bytes(self.device), self.device),
                    load_strategy=o.load_strategy,
                    microbatch_tokens=o.microbatch_tokens,
                    previous_session=previous_session(self.state_dir, o.server))
                break
            except NameTaken as err:
                # a member of this name that died without its session reaching the disk
                # here holds the name until the coordinator stops hearing from it
                if time.monotonic() > give_up:
                    raise
                self.log(f"{err.details} Retrying in {NAME_RETRY_S:g} s.")
                time.sleep(NAME_RETRY_S)
        save_session(self.state_dir, o.server, self.connection.session_token)
        self.member = member
        self.summary = ClientSummary(client_id=member.client_id, tier=member.tier,
                                     threads=self.options.threads or torch.get_num_threads())
        self.sequences = SequenceSource(self.connection, member.settings, local=o.data)
        self.log(f"joined as {o.name} (session {member.client_id}) at tier {member.tier} "
                 f"(FFN width {member.ffn_width}): {member.tier_reason}")
        # loading, the speed probe and catching up can take longer than the coordinator's
        # heartbeat timeout on a slow machine: keep the new member alive meanwhile
        with self.connection.keep_alive(lambda: member.round if self.replica is None
                                        else self.applied):
            self._load(member.checkpoint or self.connection.latest_checkpoint())
            probe = dict(tier=self.named, sequence_length=member.settings.sequence_length,
                         batch_tokens=o.microbatch_tokens, steps=2, precision=o.precision)
            speed = self.node.speed(
                lambda: measure_tokens_per_second(self.replica.model, **probe), probe
            ) * o.compute_speed
            self.connection.heartbeat(self.applied, tokens_per_second=speed)
            self.log(f"measured {speed:,.0f} training tokens/s at tier {self.tier}; catching "
                     f"up from round {self.applied}")
            self.catch_up()
            self.build_local_round()

    def _train_rounds(self) -> None:
        """The round loop: synchronous, or overlapped when the run says so."""
        loop = OverlappedRounds if self.member.settings.overlap else SynchronousRounds
        loop(self).run()

    def train_round(self, work: Train, progress: Progress) -> None:
        if self.local_round is None:
            self.build_local_round()
        with self.connection.keep_alive(lambda: work.round):
            try:
                sequences = [s.to(self.device) for s in self.sequences.fetch(work.sequence_ids)]
            except RoundOver as err:
                self.log(f"round {work.round} is over for this client: {err.details}")
                return
            done = self.compute(sequences, work.round)
            loss = done.losses[tier_label(self.named)]
            try:
                accepted, sent, _ = self.connection.submit(
                    work, client_id=self.summary.client_id, tokens=done.tokens, loss=loss,
                    train_seconds=done.seconds, results=done.results)
            except RoundOver as err:
                # Too late (the round closed at its deadline, or the coordinator restarted
                # and split it anew) or refused: the gradient was not taken, so the momentum
                # goes back to the last accepted round's.
                self.log(f"round {work.round} not accepted: {err.details}")
                self.restore_state()
                return
        self.accepted(work, done, loss, sent, accepted, progress)

    def compute(self, sequences: list[torch.Tensor], round_index: int,
                 advance: Advance | None = None) -> RoundWork:
        """A round's local work on every rank (``advance``: ``LocalRound.run``'s); with
        ``compute_speed`` below 1, then a pause to take 1 / compute_speed times as long
        (with ``busy_s``, only in the busy half of each period: the first ``busy_s`` seconds
        from the client's start, every other ``busy_s`` seconds after)."""
        self.node.train(sequences, round_index)
        done = self.local_round.run(sequences, step=round_index, advance=advance)
        speed = speed_at(self.options.compute_speed, self.options.busy_s,
                         time.monotonic() - self.started)
        if speed < 1:
            pause = done.seconds * (1 / speed - 1)
            time.sleep(pause)
            done = dataclasses.replace(done, seconds=done.seconds + pause)
        return done

    def accepted(self, work: Train, done: RoundWork, loss: float, sent: int, accepted: int,
                  progress: Progress) -> None:
        """A submission the coordinator took: the error feedback saved, the round counted."""
        self.local_round.save(feedback_path(self.state_dir))
        self.cost.compute_s += done.seconds
        self.cost.dense_up += self._dense_bytes()
        self.summary.rounds_trained += 1
        self.summary.bytes_sent += sent
        self.summary.losses.append((work.round, loss))
        progress.update(work, self.tier, loss, done.tokens / done.seconds, sent, accepted)

    # -- weights ------------------------------------------------------------------------

    def _load(self, checkpoint: PublishedCheckpoint) -> None:
        self.replica = load_replica(
            self.broadcast, checkpoint, self.named, strategy=self.options.load_strategy,
            cache=self.state_dir / "checkpoints", mirror=self.mirror, device=self.device,
            schema_hash=self.member.schema_hash, log=self.log,
            trust_remote_code=self.options.trust_remote_code)
        self.node.load(self.replica, self.options.compile)
        if self.options.compile:
            compile_model(self.replica.model)
        self.applied = checkpoint.round
        self.local_round = None  # it trained the replica just replaced: built anew on use

    def catch_up(self, *, reload: bool = False) -> None:
        """Apply every logged update since ``applied``. Load the latest checkpoint first when
        ``reload`` is set, when the log no longer reaches back to ``applied``, or when the
        replica's hash disagrees with the coordinator's after an update; a second
        disagreement after a reload means the files themselves are damaged."""
        reloaded = False
        while True:
            if reload:
                self._load(self.connection.latest_checkpoint())
                reloaded = True
            try:
                updates = self.broadcast.updates(self.applied, self.tier)
            except UpdatesPruned:
                if reloaded:
                    raise
                self.log(f"updates since round {self.applied} are pruned; reloading the "
                         "checkpoint")
                reload = True
                continue
            diverged = self.replay(updates)
            if diverged is None:
                break
            self.summary.resynchronisations += 1
            if reloaded:
                raise ReplicaDiverged(
                    f"after reloading the latest checkpoint and replaying, the replica's "
                    f"weight hash after round {diverged} still differs from the "
                    "coordinator's; the checkpoint files or the update log are damaged.")
            self.log(f"weight hash after round {diverged} differs from the coordinator's; "
                     "reloading the checkpoint")
            reload = True
        self.summary.rounds_applied = self.applied
        self.summary.update_bytes = self.broadcast.update_bytes

    def replay(self, updates: list[RoundUpdate]) -> int | None:
        """Apply ``updates`` from round ``applied`` on; the first round after which the
        replica's hash differs from the one the coordinator published, else None (the
        broadcast hears of it: a mirror's round is taken from the coordinator after)."""
        applied, start = [], time.monotonic()
        try:
            for update in updates:
                if update.round < self.applied:
                    continue
                self.replica.apply(update)
                applied.append(update)
                self.applied = update.round + 1
                self.cost.dense_down += self._dense_bytes()
                published = update.hashes.get(self.tier)
                if published and self.replica.hash(self.named) != published:
                    self.broadcast.disagreed(update.round)
                    return update.round
            return None
        finally:
            self.node.apply(applied)
            self.cost.apply_s += time.monotonic() - start

    def _dense_bytes(self) -> int:
        """float32 bytes of the weights this client's tier holds: a dense gradient's size."""
        regions = tier_regions(self.replica.shapes, self.replica.config, self.named)
        return DENSE_BYTES_PER_VALUE * sum(math.prod(region_shape(r)) for r in regions.values())

    def build_local_round(self) -> None:
        o, settings = self.options, self.member.settings
        ids = settings.tier_ids()
        setup = RoundSetup(
            tiers=(self.named, *(ids.resolve(t) for t in sorted(set(o.also_train))
                                 if t != self.tier and ids.within(t, self.tier))),
            microbatch_tokens=o.microbatch_tokens, microbatch_examples=o.microbatch_examples,
            pad_to_multiple_of=o.pad_to_multiple_of,
            steps=LocalSteps.of(settings.inner), precision=o.precision,
            row_length=settings.sequence_length if o.batching == "packed" else None)
        self.node.setup(setup)
        self.local_round = setup.build(self.replica, settings.compression.build(),
                                       self.node.parallel)
        self.restore_state(announce=True)

    # -- state kept across restarts ---------------------------------------------------------

    def restore_state(self, announce: bool = False) -> None:
        """The error-feedback momentum (and inner optimizer state) of the last accepted
        round: from the state dir, or fresh when none was saved or the saved one does not
        fit (then it is deleted)."""
        path = feedback_path(self.state_dir)
        if path.is_file():
            try:
                self.local_round.restore(path)
            except FeedbackStateMismatch as err:
                self.log(f"not restoring the error feedback: {err}")
                path.unlink()
            else:
                if announce:
                    self.log(f"restored the error-feedback momentum from {path}")
                self.node.restore(self.local_round)
                return
        self.local_round.reset()
        self.node.restore(self.local_round)

    def _write_summary(self) -> None:
        """``summary.json`` in the state dir: what local-testnet's end-of-run check reads."""
        if self.summary is not None:
            weights = self.replica.hash(self.named) if self.replica is not None else ""
            write_summary(self.summary, self.cost, self.connection, weights, self.state_dir)

    def leave(self, reason: str) -> None:
        try:
            if self.connection.joined:
                self.connection.leave(reason)
        except ClientError:
            pass  # leaving is a courtesy: the coordinator drops silent members anyway
        finally:
            self.connection.close()
