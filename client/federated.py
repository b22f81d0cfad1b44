"""`matformer-client train --server HOST:PORT`: one participant of a federated run.

    summary = FederatedClient(FederatedOptions(server="127.0.0.1:7070", tier=1)).run()

1. Probe the device (kind, name, memory) and join with the run's join token. The coordinator
   assigns the tier, says why, and names its latest checkpoint.
2. Resolve that checkpoint through its manifest for the assigned tier and ``--load-strategy``
   (the slice when the manifest lists it, else the universal checkpoint sliced at load),
   fetching each file from the coordinator, or from ``--checkpoint`` (a local or hub copy of
   the run's checkpoints) when its sha256 matches the manifest. Check the model's canonical
   schema hash against the run's, measure tokens/s at the tier on a short warm-up and report
   it (the coordinator sizes this client's share by it), then replay the logged updates.
3. Each round: fetch the assigned sequences (from the coordinator, or ``--data``, a local MDAT
   whose fingerprint matches), accumulate gradients at the tier(s) in token-budget
   microbatches, compress with error feedback, submit; then apply the broadcast update and
   compare the replica's weight hash with the coordinator's; on a mismatch, reload the latest
   checkpoint and replay. The error-feedback momentum is saved after every accepted round, so
   a restarted client keeps the gradient it has not sent yet.

The model comes from the coordinator, so the speed is measured after joining and reported
with the first heartbeat; until a round measures it, the coordinator uses that report.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import torch

from client.connection import CheckpointFiles, Connection, Refused, Unreachable
from client.errors import ClientError, DataMismatch, FeedbackStateMismatch, ReplicaDiverged
from client.local_round import LocalRound
from client.probe import device_name, measure_tokens_per_second, memory_bytes
from client.replica import Replica
from modeling.atomic import write_json_atomic
from modeling.batching import AdaptiveLimitsConfig
from modeling.checkpoint.loader import STRATEGIES, load, resolve
from modeling.checkpoint.repository import HubRepository, LocalRepository
from modeling.checkpoint.schema import canonical_schema_hash
from modeling.compression import (
    DENSE_BYTES_PER_VALUE,
    CompressionConfig,
    RoundUpdate,
    region_shape,
    tier_regions,
)
from modeling.matformer import tier_label
from modeling.mdat import Mdat
from modeling.training import TierSchedule
from protocol.matformer.v1 import coordinator_pb2 as pb

JOIN_TOKEN_ENV = "MATFORMER_JOIN_TOKEN"
FEEDBACK_FILE = "error_feedback.safetensors"
SUMMARY_FILE = "summary.json"  # written in the state dir when the client stops
# the session token of the last join (0600): a restarted client presents it, so that the
# coordinator lets it take its name back from the member it was
SESSION_FILE = "session.json"
NAME_PATIENCE_S = 90.0  # how long a Join waits for its name to be freed (ALREADY_EXISTS)
NAME_RETRY_S = 5.0
MAX_REJOINS = 3  # joins in a row after the coordinator forgot this client's session
DOWNLOADS = ("GetUpdates", "FetchSequences", "DownloadCheckpoint")  # the calls that download
# The coordinator ended this round for the client (it closed, restarted or dropped the
# client): results not accepted, nothing sent, on to the next assignment.
ROUND_OVER = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)


@dataclass(kw_only=True)
class FederatedOptions:
    server: str  # HOST:PORT of the coordinator's gRPC service
    tier: int | None = None  # the smallest tier index (largest model) wanted; None: any
    load_strategy: str = "auto"  # auto | sliced | universal
    checkpoint: str = "server"  # server | a folder | hf:ORG/NAME holding the run's checkpoints
    data: Path | None = None  # a local copy of the run's MDAT; None: sequences from the server
    device: str = "cpu"
    join_token: str | None = None  # None: $MATFORMER_JOIN_TOKEN
    name: str = field(default_factory=socket.gethostname)
    run_id: str = ""  # when set, the coordinator refuses to admit the client to another run
    state_dir: Path | None = None  # cache and error feedback; None: runs/clients/<name>
    tls_ca: Path | None = None  # PEM certificate to trust; None: plaintext
    microbatch_tokens: int = 2048  # padded tokens per forward/backward pass (shrinks on OOM)
    also_train: tuple[int, ...] = ()  # smaller nested tiers trained in the same step
    latency_ms: float = 0.0  # added before every call: local-testnet's simulated WAN
    bandwidth_mbit: float = 0.0  # each way, on every message (protocol/link.py); 0: none
    max_rounds: int | None = None  # leave after training this many rounds; None: until the end
    progress: bool | None = None  # a progress bar; None: when stderr is a terminal


@dataclass(kw_only=True)
class ClientSummary:
    client_id: str
    tier: int
    rounds_trained: int = 0
    rounds_applied: int = 0  # the replica holds the weights after this many rounds
    resynchronisations: int = 0
    losses: list[tuple[int, float]] = field(default_factory=list)  # (round, loss)
    bytes_sent: int = 0
    update_bytes: int = 0  # GetUpdates messages received (before gRPC's gzip)
    finished: bool = False  # the coordinator said the run is over
    weight_hash: str = ""  # the replica's, at its tier, after ``rounds_applied`` rounds
    rejoins: int = 0  # times it joined again after its session ended
    # What it cost, over the whole process (rejoins included): every message each way as
    # serialized (before gRPC's gzip), against float32 of the tier's weights per round
    # trained (up) and applied (down); seconds training, sending results, downloading
    # (updates, sequences, checkpoint files), waiting for a round, and in all.
    bytes_up: int = 0
    bytes_down: int = 0
    dense_bytes_up: int = 0
    dense_bytes_down: int = 0
    compute_s: float = 0.0
    up_s: float = 0.0
    down_s: float = 0.0
    wait_s: float = 0.0
    wall_s: float = 0.0


@dataclass
class _Cost:
    """What the summary's cost fields add up, kept across rejoins."""

    started: float = field(default_factory=time.monotonic)
    compute_s: float = 0.0
    wait_s: float = 0.0
    dense_up: int = 0  # float32 bytes of the tier's weights, per round trained
    dense_down: int = 0  # ... per round applied


class FederatedClient:
    def __init__(self, options: FederatedOptions, log: Callable[[str], None] | None = None
                 ) -> None:
        if options.load_strategy not in STRATEGIES:
            raise ClientError(f"--load-strategy {options.load_strategy!r} is not one of "
                              f"{', '.join(STRATEGIES)}.")
        self.options = options
        self.log = log or (lambda line: print(line, flush=True))
        self.device = torch.device(options.device)
        self.state_dir = options.state_dir or Path("runs/clients") / options.name
        self.connection = Connection(options.server, tls_ca=options.tls_ca,
                                     latency_s=options.latency_ms / 1000,
                                     bandwidth_mbit=options.bandwidth_mbit)
        self.replica: Replica | None = None
        self.local_round: LocalRound | None = None
        self.summary: ClientSummary | None = None
        self.settings = pb.TrainingSettings()
        self._reader = None
        self._cost = _Cost()

    # -- the run ------------------------------------------------------------------------

    def run(self) -> ClientSummary:
        """Join, catch up, train rounds until the run finishes (or ``max_rounds``), leave.
        Ctrl-C (KeyboardInterrupt) leaves the run before it propagates."""
        try:
            self._join()
            self._rounds_rejoining()
        except KeyboardInterrupt:
            self._leave("interrupted (Ctrl-C)")
            raise
        except Exception as err:
            # hand the round's sequences back now rather than at the deadline
            self._leave(f"failed: {err}"[:500])
            raise
        finally:
            self._write_summary()
        self._leave("finished" if self.summary.finished else "done")
        return self.summary

    def _rounds_rejoining(self) -> None:
        """Train rounds; when the coordinator no longer knows the session (it expired while
        this machine slept, or the coordinator lost it), join again and go on."""
        rejoins = 0
        while True:
            try:
                return self._train_rounds()
            except Refused as err:
                if err.code == grpc.StatusCode.PERMISSION_DENIED:
                    raise ClientError(f"the coordinator excluded this client: {err.details}"
                                      ) from None
                if err.code != grpc.StatusCode.UNAUTHENTICATED or rejoins >= MAX_REJOINS:
                    raise
                rejoins += 1
                self.log(f"the coordinator ended this client's session ({err.details}); "
                         "joining again")
                previous = self.summary
                self._join()
                self.summary.rejoins = previous.rejoins + 1
                self.summary.rounds_trained += previous.rounds_trained
                self.summary.bytes_sent += previous.bytes_sent
                self.summary.losses[:0] = previous.losses

    def _join(self) -> None:
        o = self.options
        token = o.join_token if o.join_token is not None else os.environ.get(JOIN_TOKEN_ENV, "")
        capabilities = pb.Capabilities(
            device_kind=self.device.type, device_name=device_name(self.device),
            memory_bytes=memory_bytes(self.device), load_strategy=o.load_strategy,
            microbatch_tokens=o.microbatch_tokens)
        if o.tier is not None:
            capabilities.requested_tier = o.tier
        request = pb.JoinRequest(run_id=o.run_id, join_token=token, capabilities=capabilities,
                                 client_name=o.name)
        give_up = time.monotonic() + NAME_PATIENCE_S
        while True:
            try:
                reply = self.connection.join(request, previous_session=self._previous_session())
                break
            except Refused as err:
                # a member of this name that died without its session reaching the disk
                # here holds the name until the coordinator stops hearing from it
                if err.code != grpc.StatusCode.ALREADY_EXISTS or time.monotonic() > give_up:
                    raise
                self.log(f"{err.details} Retrying in {NAME_RETRY_S:g} s.")
                time.sleep(NAME_RETRY_S)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.state_dir / SESSION_FILE,
                          {"server": o.server, "session_token": reply.session_token}, mode=0o600)
        self.settings = reply.settings
        self.summary = ClientSummary(client_id=reply.client_id, tier=reply.tier)
        self.log(f"joined as {reply.client_id} at tier {reply.tier} (FFN width "
                 f"{reply.ffn_width}): {reply.tier_reason}")
        self.schema_hash = reply.schema_hash
        # loading and the speed probe can take longer than the coordinator's heartbeat
        # timeout on a slow machine: keep the new member alive meanwhile
        with _Heartbeat(self.connection, self.settings.heartbeat_seconds, lambda: reply.round,
                        self.log):
            self._load(reply.checkpoint if reply.HasField("checkpoint") else None)
            speed = measure_tokens_per_second(
                self.replica.model, self.tier, sequence_length=self.settings.sequence_length,
                batch_tokens=o.microbatch_tokens, steps=2)
        self.connection.heartbeat(self.applied, tokens_per_second=speed)
        self.log(f"measured {speed:,.0f} training tokens/s at tier {self.tier}; catching up "
                 f"from round {self.applied}")
        self._catch_up()
        self._build_local_round()

    def _train_rounds(self) -> None:
        o = self.options
        progress = _Progress(self.log, o.progress if o.progress is not None
                             else sys.stderr.isatty())
        try:
            while o.max_rounds is None or self.summary.rounds_trained < o.max_rounds:
                assignment = self.connection.get_round()
                if assignment.state == pb.ROUND_STATE_FINISHED:
                    self._catch_up()
                    self.summary.finished = True
                    digest = self.replica.hash(self.tier)[:12]
                    self.log(f"the run finished after round {assignment.round - 1}; replica "
                             f"at round {self.applied}, weight hash {digest}")
                    return
                if assignment.state != pb.ROUND_STATE_TRAIN:
                    if assignment.round > self.applied:
                        self._catch_up()
                    pause = max(assignment.retry_after_seconds, 0.05)
                    time.sleep(pause)
                    self._cost.wait_s += pause
                    continue
                if assignment.round > self.applied:
                    self._catch_up()
                if assignment.round != self.applied:
                    continue  # the log lags the round that opened; ask again
                if assignment.tier != self.tier:
                    self.log(f"the coordinator moved this client from tier {self.tier} to "
                             f"tier {assignment.tier}; reloading")
                    self.summary.tier = assignment.tier
                    self._reload()
                    self._build_local_round()
                self._train_one(assignment, progress)
        finally:
            progress.close()

    def _train_one(self, assignment: pb.RoundAssignment, progress: _Progress) -> None:
        ids = list(assignment.sequence_ids)
        with _Heartbeat(self.connection, self.settings.heartbeat_seconds,
                        lambda: assignment.round, self.log):
            try:
                sequences = [s.to(self.device) for s in self._sequences(ids)]
            except Refused as err:
                if err.code not in ROUND_OVER:
                    raise
                self.log(f"round {assignment.round} is over for this client: {err.details}")
                return
            work = self.local_round.run(sequences, step=assignment.round)
            loss = work.losses[tier_label(self.tier)]
            header = pb.SubmitHeader(round=assignment.round, client_id=self.summary.client_id,
                                     tokens=work.tokens, loss=loss, train_seconds=work.seconds,
                                     assignment_id=assignment.assignment_id)
            try:
                accepted, sent = self.connection.submit(header, work.results)
            except Refused as err:
                if err.code not in ROUND_OVER:
                    raise
                # Too late (the round closed at its deadline, or the coordinator restarted
                # and split it anew) or refused: the gradient was not taken, so the momentum
                # goes back to the last accepted round's.
                self.log(f"round {assignment.round} not accepted: {err.details}")
                self._restore_feedback()
                return
        self.local_round.feedback.save(self._feedback_path())
        self._cost.compute_s += work.seconds
        self._cost.dense_up += self._dense_bytes()
        self.summary.rounds_trained += 1
        self.summary.bytes_sent += sent
        self.summary.losses.append((assignment.round, loss))
        progress.update(assignment.round, self.tier, loss, work.tokens / work.seconds, sent,
                        accepted)

    # -- weights ------------------------------------------------------------------------

    @property
    def tier(self) -> int:
        return self.summary.tier

    def _load(self, ref: pb.CheckpointRef | None) -> None:
        """Load the checkpoint ``ref`` names for the tier (or the latest, when None)."""
        if ref is None:
            ref = self.connection.get_checkpoint()
        files = CheckpointFiles(self.connection, self.state_dir / "checkpoints", self._mirror(),
                                log=self.log)
        folder = ref.manifest_path.rpartition("/")[0]
        resolved = resolve(folder, self.tier, self.options.load_strategy, repository=files)
        model = load(resolved).to(self.device)
        got = canonical_schema_hash(model.config, Replica(model).shapes)
        if self.schema_hash and got != self.schema_hash:
            raise ClientError(f"the checkpoint {folder} loads a model with canonical schema "
                              f"hash {got}, the run's is {self.schema_hash}; its files do not "
                              "belong to this run.")
        self.replica = Replica(model)
        self.applied = ref.round
        fetched = f"{len(files.downloaded)} files downloaded" + (
            f", {len(files.mirrored)} from {self.options.checkpoint}" if files.mirrored else "")
        self.log(f"loaded {folder} ({resolved.used}: {resolved.reason}; {fetched}); "
                 f"{sum(p.numel() for p in model.parameters()):,} parameters")

    def _reload(self) -> None:
        self._load(None)
        self._catch_up(reloaded=True)

    def _catch_up(self, reloaded: bool = False) -> None:
        """Apply every logged update since ``applied``; reload the latest checkpoint when the
        log no longer reaches back that far or the replica's hash disagrees."""
        try:
            updates = self.connection.updates(self.applied, self.tier)
        except Refused as err:
            if err.code != grpc.StatusCode.OUT_OF_RANGE or reloaded:
                raise
            self.log(f"updates since round {self.applied} are pruned; reloading the checkpoint")
            return self._reload()
        for update in updates:
            if update.round < self.applied:
                continue
            self._apply(update)
            published = update.hashes.get(self.tier)
            if published and self.replica.hash(self.tier) != published:
                self.summary.resynchronisations += 1
                if reloaded:
                    raise ReplicaDiverged(
                        f"after reloading the latest checkpoint and replaying, the replica's "
                        f"weight hash after round {update.round} still differs from the "
                        "coordinator's; the checkpoint files or the update log are damaged.")
                self.log(f"weight hash after round {update.round} differs from the "
                         "coordinator's; reloading the checkpoint")
                return self._reload()
        self.summary.rounds_applied = self.applied
        self.summary.update_bytes = self.connection.update_bytes

    def _dense_bytes(self) -> int:
        """float32 bytes of the weights this client's tier holds: a dense gradient's size."""
        regions = tier_regions(self.replica.shapes, self.replica.config, self.tier)
        return DENSE_BYTES_PER_VALUE * sum(math.prod(region_shape(r)) for r in regions.values())

    def _apply(self, update: RoundUpdate) -> None:
        self.replica.apply(update)
        self.applied = update.round + 1
        self._cost.dense_down += self._dense_bytes()

    def _build_local_round(self) -> None:
        s = self.settings
        compressor = CompressionConfig(encoding=s.encoding, chunk=s.chunk, topk=s.topk,
                                       value_dtype=s.value_dtype, decay=s.decay,
                                       lr=s.compression_lr).build()
        tiers = [self.tier, *sorted(t for t in set(self.options.also_train) if t > self.tier)]
        self.local_round = LocalRound(
            self.replica, compressor, TierSchedule(tiers=tiers, mode="all"),
            AdaptiveLimitsConfig(max_tokens=self.options.microbatch_tokens).build())
        self._restore_feedback(announce=True)

    # -- error feedback -----------------------------------------------------------------

    def _feedback_path(self) -> Path:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        return self.state_dir / FEEDBACK_FILE

    def _restore_feedback(self, announce: bool = False) -> None:
        path = self._feedback_path()
        if not path.is_file():
            for state in self.local_round.feedback.feedback.values():
                state.momentum.zero_()
            return
        try:
            self.local_round.feedback.load(path)
        except FeedbackStateMismatch as err:
            self.log(f"not restoring the error feedback: {err}")
            path.unlink()
            return self._restore_feedback()
        if announce:
            self.log(f"restored the error-feedback momentum from {path}")

    # -- data ---------------------------------------------------------------------------

    def _sequences(self, ids: list[int]) -> list[torch.Tensor]:
        if self.options.data is None:
            return self.connection.fetch_sequences(ids)
        reader = self._local_reader()
        return [torch.from_numpy(reader[i].astype(np.int64)) for i in ids]

    def _local_reader(self):
        if self._reader is None:
            s = self.settings
            mdat = Mdat.open(self.options.data)
            reader = mdat.sequences(s.data_strategy, s.sequence_length, s.data_view or None)
            if reader.fingerprint != s.data_fingerprint:
                raise DataMismatch(
                    f"--data {self.options.data} ({s.data_strategy}, view "
                    f"{s.data_view or 'all'}) has fingerprint {reader.fingerprint}, the run's "
                    f"data {s.data_fingerprint}; copy the run's MDAT, or leave out --data to "
                    "fetch sequences from the coordinator.")
            self._reader = reader
        return self._reader

    def _mirror(self):
        source = self.options.checkpoint
        if source == "server":
            return None
        if source.startswith("hf:"):
            return HubRepository(source.removeprefix("hf:"))
        path = Path(source).expanduser()
        if not path.is_dir():
            raise ClientError(f"--checkpoint {source} is neither 'server', a folder nor "
                              "hf:ORG/NAME; point it at a copy of the run's checkpoints.")
        return LocalRepository(path)

    def _previous_session(self) -> str | None:
        """The session token this client held with this server before, if it kept one."""
        try:
            saved = json.loads((self.state_dir / SESSION_FILE).read_text())
        except (OSError, ValueError):
            return None  # none yet, or unreadable: join as a newcomer
        if not isinstance(saved, dict) or saved.get("server") != self.options.server:
            return None
        token = saved.get("session_token")
        return token if isinstance(token, str) and token else None

    def _write_summary(self) -> None:
        """``summary.json`` in the state dir: what local-testnet's end-of-run check reads."""
        if self.summary is None:
            return
        if self.replica is not None:
            self.summary.weight_hash = self.replica.hash(self.tier)
        cost, seconds = self._cost, self.connection.call_seconds
        summary = self.summary
        summary.bytes_up = self.connection.meter.bytes_up
        summary.bytes_down = self.connection.meter.bytes_down
        summary.dense_bytes_up, summary.dense_bytes_down = cost.dense_up, cost.dense_down
        summary.compute_s, summary.wait_s = round(cost.compute_s, 3), round(cost.wait_s, 3)
        summary.up_s = round(seconds["SubmitResult"], 3)
        summary.down_s = round(sum(seconds[n] for n in DOWNLOADS), 3)
        summary.wall_s = round(time.monotonic() - cost.started, 3)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        path = self.state_dir / SUMMARY_FILE
        path.write_text(json.dumps(dataclasses.asdict(self.summary), indent=1) + "\n")

    def _leave(self, reason: str) -> None:
        try:
            if self.connection.metadata:  # joined
                self.connection.leave(reason)
        except ClientError:
            pass  # leaving is a courtesy: the coordinator drops silent members anyway
        finally:
            self.connection.close()


class _Heartbeat:
    """Heartbeats every ``interval_s`` on a background thread while a round is trained, so
    the coordinator tells a busy client from a hung one. Failures are the coordinator's to
    notice (a missed heartbeat); the thread only logs the first one."""

    def __init__(self, connection: Connection, interval_s: float,
                 round_index: Callable[[], int], log: Callable[[str], None]) -> None:
        self.connection = connection
        self.interval_s = interval_s
        self.round_index = round_index
        self.log = log
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="matformer-heartbeat",
                                        daemon=True)

    def __enter__(self) -> _Heartbeat:
        if self.interval_s > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)

    def _beat(self) -> None:
        warned = False
        while not self._stop.wait(self.interval_s):
            try:
                self.connection.heartbeat(self.round_index(), patience_s=self.interval_s)
            except (Refused, Unreachable) as err:
                if not warned:
                    self.log(f"heartbeat failed: {err}")
                    warned = True


class _Progress:
    """One line per round: a tqdm bar on a terminal, plain lines in a log."""

    def __init__(self, log: Callable[[str], None], bar: bool) -> None:
        self.log = log
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(unit="round", dynamic_ncols=True)

    def update(self, round_index: int, tier: int, loss: float, speed: float, sent: int,
               accepted: int) -> None:
        if self.bar is not None:
            self.bar.set_description(f"round {round_index}")
            self.bar.set_postfix(tier=tier, loss=f"{loss:.3f}", tok_s=f"{speed:,.0f}",
                                 sent=f"{sent / 1024:.0f}KiB")
            self.bar.update(1)
        else:
            self.log(f"round {round_index:>4}  tier {tier}  loss {loss:.3f}  {speed:,.0f} tok/s"
                     f"  sent {sent / 1024:,.1f} KiB ({accepted} results)")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
