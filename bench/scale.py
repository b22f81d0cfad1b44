"""A round at scale: what the coordinator and each client spend for 1, 4, 16 and 64 clients.

One process starts a real ``matformer-server`` (``RunningServer.start`` on loopback, ports 0)
for each client count N, with ``min_clients = N``, and drives N simulated clients through the
real gRPC stubs: Join (each asks for tier ``i % 3``), then per round GetRound and
SubmitResult. The clients train nothing: before any timing, each encodes a random gradient
of its tier's region of every parameter through error feedback, as a client does
(``CompressionConfig`` defaults unless flags override them: DCT, chunk 64, top 32, bfloat16
values), and the encoded messages are sent again every round with a new header and the
round's assigned token count.

On the coordinator (its instance's methods and its module's ``close_round`` wrapped; server
code untouched): ``close``, the whole close of a round (``RoundClose.close``: aggregate
every parameter over the clients' results and compress it for the broadcast, apply the update
rule to the master, hash it per tier, log the update, save state.json), and inside it
``aggregate + step`` (``close_round``: the aggregates, the broadcast's steps, the new
master), ``score`` (``server.scores.agreement``: each result's contribution score),
``hash`` (``tier_hashes``), ``log + save`` and ``rest``. Checkpoints are kept out
(the interval is longer than the run). While each timed round closes, a prober thread sends
Heartbeat and GetRound in turn and records how long each takes to answer: ``hb p99``, the
99th percentile over every timed round.

Per round, for a tier-0 client (the largest): ``up``, the bytes of its submission;
``down``, the bytes of one round's GetUpdates as it downloads them; ``dense``, float32 of its
weights (what a dense gradient up or dense weights down would take), and ``x below dense``,
(dense up + dense down) / (up + down). ``apply s``: a tier-0 client's seconds to fetch one
round's update and apply it to its weights. ``rss MiB``: the peak resident memory of this
process (server and simulated clients together).

Each client count plays one untimed warm-up round, then ``--rounds`` timed ones; medians are
shown. The benchmark keeps the clients' reported speeds (``membership.measured`` is a no-op:
they submit one after another without training), so every client gets an equal share.
The close and the apply are also counted in passes over the weights: ``1 pass ms`` is one
float32 read and write of every element of the master (an in-place multiply of a copy),
timed in the same run; ``close passes`` = close / one pass, ``apply passes`` = the tier-0
client's apply (``apply_s``, the download left out) / one pass. Targets (issue 48): close
passes <= 8, apply passes <= 6.
``--json OUT`` writes one object per N with ``clients``, ``close_ms``, ``score_ms``, ``bytes_up``,
``bytes_down``, ``dense_bytes_up``, ``dense_bytes_down``, ``update_apply_s``, ``apply_s``,
``one_pass_ms``, ``close_passes``, ``apply_passes``,
``heartbeat_p99_ms`` (and ``getround_p99_ms``, ``peak_rss_mib``). Targets (issue 16): up +
down at least 100x below dense at every N, close at 64 clients at most 3x close at 1,
heartbeat p99 at most 50 ms.

    python bench/scale.py                      # 4M parameters, 1, 4, 16, 64 clients (1 min)
    python bench/scale.py --shape 150m --clients 1,4,16,64 --json runs/scale.json
    python bench/scale.py --smoke              # 0.2M parameters, 1 and 2 clients: it runs
    python bench/scale.py --shape 150m --clients 4 --shards 1,2   # the sharded close

``--shards 1,2`` runs every client count with the close in one process and over 2 shard
processes ([coordinator] shards, server/shards.py) and prints their close against each other
and each process's resident memory (``shard_rss_mib``, ``shard_peak_rss_mib`` in the JSON;
the coordinator's process first, which also holds the simulated clients).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import json
import math
import os
import resource
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
from harness import parse, print_table

import matformer.server.close as round_close  # the close scores results with agreement
import matformer.server.policies.mean as close_module  # the default policy calls close_round
from matformer.modeling import ModelConfig
from matformer.modeling.compression import (
    DENSE_BYTES_PER_VALUE,
    CompressionConfig,
    SparseResult,
    region_shape,
    region_slices,
    tier_regions,
    universal_shapes,
)
from matformer.modeling.mdat import build_default_mdat
from matformer.protocol.auth import session_metadata
from matformer.protocol.channel import GRPC_OPTIONS
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.protocol.sparse import encode_sparse_result
from matformer.protocol.submission import result_batches
from matformer.protocol.updates import read_updates
from matformer.server.config import RunConfig
from matformer.server.coordinator import Coordinator
from matformer.server.main import RunningServer

NAN = float("nan")
JOIN_TOKEN = "bench"
RELAY_TOKEN = "bench-relay"  # what the relays present to the root (many_members --relays)
RESULT_TOKENS = 512  # the count encoded at first; each round sends its assignment's count
SHAPES = {"150m": {"hidden_size": 768, "layers": 12, "heads": 12, "kv_heads": 12,
                  "intermediate_size": 3072, "vocab_size": 32000}}
PROBE_S = 0.005  # the prober's pause between calls while a round closes
# timed inside close; "rest" is the remainder
STEPS = ("aggregate + step", "score", "hash", "log + save")
SMOKE = dict(vocab_size=260, hidden_size=64, layers=2, heads=4, kv_heads=2,
             intermediate_size=256, clients="1,2", rounds=1, threads=1, shards="1,2")


def parse_args() -> argparse.Namespace:
    defaults = CompressionConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = parser.add_argument_group("model")
    model.add_argument("--shape", choices=sorted(SHAPES), default=None,
                       help="a named shape; sets the five flags below (150m: 162M parameters, "
                            "hidden 768, 12 layers, FFN 3072, vocab 32000)")
    model.add_argument("--vocab-size", type=int, default=260)
    model.add_argument("--hidden-size", type=int, default=256)
    model.add_argument("--layers", type=int, default=4)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--kv-heads", type=int, default=2)
    model.add_argument("--intermediate-size", type=int, default=1024)
    model.add_argument("--seq-len", type=int, default=128,
                       help="tokens per sequence (a multiple of 128, the MDAT chunk)")
    run = parser.add_argument_group("run")
    run.add_argument("--clients", default="1,4,16,64", help="client counts, comma-separated")
    run.add_argument("--tiers", default="0,1,2", help="client i asks for tier tiers[i %% len]")
    run.add_argument("--rounds", type=int, default=3, help="timed rounds per client count")
    run.add_argument("--rule", choices=["sign", "sgd"], default="sign")
    run.add_argument("--momentum", type=float, default=0.0,
                     help="[update] momentum, Nesterov (rule sgd; DiLoCo's outer step: 0.9)")
    run.add_argument("--broadcast-topk", type=int, default=None,
                     help="[update] broadcast_topk (default: the run's; 0: exact broadcast)")
    run.add_argument("--encoding", choices=["dense", "topk", "dct"], default=defaults.encoding)
    run.add_argument("--chunk", type=int, default=defaults.chunk)
    run.add_argument("--topk", type=int, default=defaults.topk)
    run.add_argument("--value-dtype", default=defaults.value_dtype)
    run.add_argument("--sequences-per-client", type=int, default=4,
                     help="round token budget = clients x this x --seq-len")
    run.add_argument("--threads", type=int, default=None)
    run.add_argument("--shards", default="1", help=(
        "[coordinator] shards to measure, comma-separated: each client count is run at each"))
    run.add_argument("--json", type=Path, default=None, help="write the figures per N here")
    args = parse(parser, SMOKE)
    for key, value in SHAPES.get(args.shape, {}).items():
        setattr(args, key, value)
    return args


def tiers_of(args: argparse.Namespace) -> list[int]:
    return sorted({int(t) for t in args.tiers.split(",")})


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate_size, max_position_embeddings=args.seq_len,
        pad_token_id=None, bos_token_id=None, eos_token_id=None, mask_token_id=None,
    )


def run_config(args: argparse.Namespace, clients: int, folder: Path, mdat: Path,
               shards: int = 1) -> RunConfig:
    """The run.toml tables of one client count, read as ``RunConfig.load`` reads the file."""
    tables: dict[str, Any] = {
        "run": {"id": f"bench-{clients}", "dir": str(folder / f"run-{clients}-{shards}")},
        "coordinator": {"shards": shards},
        "model": {"inline": {k: v for k, v in model_config(args).to_dict().items()
                             if v is not None}},
        "data": {"path": str(mdat), "max_seq_len": args.seq_len},
        "tiers": {"allowed": tiers_of(args)},
        # One warm-up round, the timed ones, and one more so that no timed round ends the run
        # (the last round always checkpoints). Synchronous rounds: the clients here submit
        # round r and then wait for its update.
        "round": {"min_clients": clients, "deadline_s": 3600.0, "rounds": args.rounds + 2,
                  "overlap": False,
                  "tokens_per_round": clients * args.sequences_per_client * args.seq_len},
        "update": {"rule": args.rule, "lr": 1e-3, "schedule": "constant",
                   **({"momentum": args.momentum, "nesterov": True} if args.momentum else {}),
                   **({} if args.broadcast_topk is None
                      else {"broadcast_topk": args.broadcast_topk})},
        "compression": {"encoding": args.encoding, "chunk": args.chunk, "topk": args.topk,
                        "value_dtype": args.value_dtype},
        "checkpoint": {"every_rounds": 10**6},
        # a close of a large model outlasts the default heartbeat timeout (these clients do
        # not heartbeat while they wait), and all N join at once
        "faults": {"heartbeat_timeout_s": 3600.0, "max_joins_per_minute": 100_000},
        "auth": {"join_token": JOIN_TOKEN, "relay_token": RELAY_TOKEN},
    }
    return RunConfig.from_dict(tables, base=folder)


class Submissions:
    """Each simulated client's encoded results, made once per (client index, tier)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.config = model_config(args)
        self.shapes = universal_shapes(self.config)
        self.compressor = CompressionConfig(encoding=args.encoding, chunk=args.chunk,
                                            topk=args.topk, value_dtype=args.value_dtype).build()
        self._made: dict[tuple[int, int], list[pb.SubmitMessage]] = {}

    def messages(self, index: int, tier: int) -> list[pb.SubmitMessage]:
        """The stream after the header, as a client sends it: ``results``, encoded once."""
        if (index, tier) not in self._made:
            self._made[index, tier] = list(result_batches(
                encode_sparse_result(result) for result in self.results(index, tier)))
        return self._made[index, tier]

    def results(self, index: int, tier: int) -> list[SparseResult]:
        """One result per parameter: the first round's result of a random gradient (made
        anew on each call; ``messages`` keeps only their encoding)."""
        torch.manual_seed(index)
        regions = tier_regions(self.shapes, self.config, tier)
        return [self.compressor.feedback(name, self.shapes[name], region).step(
                    torch.randn(region_shape(region)), RESULT_TOKENS)
                for name, region in sorted(regions.items())]


@dataclass(slots=True)
class Client:
    client_id: str
    tier: int
    auth: tuple[tuple[str, str], ...]  # session metadata
    messages: list[pb.SubmitMessage]

    def stream(self, round_index: int, assignment_id: str, tokens: int
               ) -> Iterator[pb.SubmitMessage]:
        """The submission of one round, weighted by the tokens the round assigned (the
        coordinator refuses any other count; a real client counts its sequences)."""
        header = pb.SubmitHeader(round=round_index, client_id=self.client_id,
                                 tokens=tokens, loss=3.0, assignment_id=assignment_id)
        yield pb.SubmitMessage(header=header)
        for message in self.messages:
            for result in message.results.results:
                result.tokens = tokens  # in place: the tensors are not copied
            yield message


@dataclass(slots=True)
class CloseTimes:
    """Seconds of one round close, in total and per step, and how many clients it merged."""

    clients: int
    steps: dict[str, float] = field(default_factory=dict)


class CloseTimer:
    """Wraps a coordinator's round close and the steps inside it (this instance only)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self.closes: list[CloseTimes] = []
        self._current: CloseTimes | None = None
        self._coordinator = coordinator
        coordinator.tier_hashes = self._step("hash", coordinator.tier_hashes)
        coordinator.log.append = self._step("log + save", coordinator.log.append)
        coordinator.save = self._step("log + save", coordinator.save)

    def close(self, close: Callable[[Any], None]) -> Callable[[Any], None]:
        """``RoundClose.close`` of this coordinator, timed; installed by ``measure``."""

        def timed(closing: Any) -> None:  # closing: server.close.Closing
            self._current = CloseTimes(clients=len(closing.delivered))
            start = time.perf_counter()
            close(closing)
            self._current.steps["close"] = time.perf_counter() - start
            self.closes.append(self._current)
            self._current = None

        return timed

    def _step(self, name: str, work: Callable[..., Any]) -> Callable[..., Any]:
        """``work``, its time added to ``name`` of the close in progress (if one is)."""

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = work(*args, **kwargs)
            if self._current is not None:
                steps = self._current.steps
                steps[name] = steps.get(name, 0.0) + time.perf_counter() - start
            return out

        return timed

    def aggregate(self, work: Callable[..., Any]) -> Callable[..., Any]:
        """``close_round``, timed; installed by ``measure`` for a run."""
        return self._step("aggregate + step", work)

    def score(self, work: Callable[..., Any]) -> Callable[..., Any]:
        """``agreement`` (the contribution scores), timed; installed by ``measure``."""
        return self._step("score", work)


@dataclass(slots=True)
class Row:
    clients: int
    closes: list[CloseTimes]
    walls: list[float]  # seconds, client side
    received: list[int]  # bytes of all submissions per round
    update_bytes: int  # GetUpdates of one round, as a tier-0 client downloads it
    update_s: float  # and the seconds that download and applying it took
    apply_s: float  # ... of them applying it
    one_pass_s: float  # one float32 read and write pass over the master, in the same run
    probes: dict[str, list[float]]  # RPC → seconds of each answer while a round closed
    up_bytes: int  # a tier-0 client's submission
    dense: int  # float32 bytes of a tier-0 client's weights
    rss_mib: float
    shards: int = 1
    # each shard process's resident memory after the timed rounds, and its peak (the
    # coordinator's process first; it also holds the simulated clients)
    shard_rss_mib: list[float] = field(default_factory=list)
    shard_peak_rss_mib: list[float] = field(default_factory=list)

    def p99_ms(self, rpc: str) -> float:
        times = sorted(self.probes[rpc])
        return times[min(len(times) - 1, int(0.99 * len(times)))] * 1e3 if times else NAN

    def figures(self) -> dict[str, float]:
        """The JSON keys of one client count."""
        return {"clients": self.clients, "close_ms": self.close_s() * 1e3,
                "score_ms": self.close_s("score") * 1e3,
                "bytes_up": self.up_bytes, "bytes_down": self.update_bytes,
                "dense_bytes_up": self.dense, "dense_bytes_down": self.dense,
                "update_apply_s": self.update_s, "apply_s": self.apply_s,
                "one_pass_ms": self.one_pass_s * 1e3,
                "close_passes": self.close_s() / self.one_pass_s,
                "apply_passes": self.apply_s / self.one_pass_s,
                "heartbeat_p99_ms": self.p99_ms("Heartbeat"),
                "getround_p99_ms": self.p99_ms("GetRound"), "peak_rss_mib": self.rss_mib,
                "shards": self.shards, "shard_rss_mib": self.shard_rss_mib,
                "shard_peak_rss_mib": self.shard_peak_rss_mib}

    def close_s(self, step: str = "close") -> float:
        return statistics.median(c.steps.get(step, 0.0) for c in self.closes)

    def rest_s(self) -> float:
        return statistics.median(
            c.steps["close"] - sum(c.steps.get(s, 0.0) for s in STEPS)
            for c in self.closes)


def join(stub: pb_grpc.CoordinatorStub, running: RunningServer, index: int, tier: int,
         submissions: Submissions) -> Client:
    reply = stub.Join(pb.JoinRequest(
        run_id=running.service.coordinator.config.run.id, join_token=JOIN_TOKEN,
        client_name=f"bench-{index}",
        capabilities=pb.Capabilities(device_kind="cpu", memory_bytes=2**40, requested_tier=tier,
                                     tokens_per_second=1000.0, load_strategy="auto"),
        schema=pb.Schema(canonical_hash=running.coordinator.schema_hash)))
    return Client(reply.client_id, reply.tier, session_metadata(reply.session_token),
                  submissions.messages(index, reply.tier))


def play_round(stub: pb_grpc.CoordinatorStub, clients: list[Client],
               coordinator: Coordinator, probes: dict[str, list[float]] | None = None
               ) -> tuple[int, float]:
    """Every client fetches its assignment, then every client submits; (round, seconds)."""
    start = time.perf_counter()
    rounds, assignments = set(), {}
    for client in clients:
        work = stub.GetRound(pb.GetRoundRequest(), metadata=client.auth)
        assignments[client.client_id] = work.assignment_id
        if work.state != pb.ROUND_STATE_TRAIN:
            raise SystemExit(f"{client.client_id} got no work in round {work.round} "
                             f"(state {work.state}); raise --sequences-per-client.")
        rounds.add(work.round)
    (round_index,) = rounds
    for i, client in enumerate(clients):
        tokens = coordinator.assignment_for(client.client_id).tokens
        submit = functools.partial(
            stub.SubmitResult, client.stream(round_index, assignments[client.client_id], tokens),
            metadata=client.auth)
        if i < len(clients) - 1 or probes is None:
            submit()
            continue
        with probing(stub, clients[0].auth, probes):  # the last submission readies the round
            submit()
            committed(coordinator, round_index)  # the close worker closes it meanwhile
    committed(coordinator, round_index)
    return round_index, time.perf_counter() - start


def committed(coordinator: Coordinator, round_index: int) -> None:
    """Until round ``round_index`` is committed (closes run on the close worker)."""
    while coordinator.state.round <= round_index:
        coordinator.wait_for_round(round_index, 1.0)


@contextlib.contextmanager
def probing(stub: pb_grpc.CoordinatorStub, auth: tuple, probes: dict[str, list[float]]
            ) -> Iterator[None]:
    """While the block runs, Heartbeat and GetRound in turn, each answer's seconds kept."""
    done = threading.Event()
    calls = {"Heartbeat": lambda: stub.Heartbeat(pb.HeartbeatRequest(), metadata=auth),
             "GetRound": lambda: stub.GetRound(pb.GetRoundRequest(), metadata=auth)}

    def probe() -> None:
        for name in itertools.cycle(calls):
            if done.is_set():
                return
            start = time.perf_counter()
            calls[name]()
            probes.setdefault(name, []).append(time.perf_counter() - start)
            time.sleep(PROBE_S)

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def measure(args: argparse.Namespace, clients: int, folder: Path, mdat: Path,
            submissions: Submissions, shards: int = 1) -> Row:
    config = run_config(args, clients, folder, mdat, shards)
    tiers = tiers_of(args)
    running = RunningServer.start(config, grpc_port=0, http_port=0)
    coordinator = running.service.coordinator
    timer = CloseTimer(coordinator)
    # These clients do no work, so the speeds their submission times suggest mean nothing.
    coordinator.membership.measured = lambda *_args, **_kwargs: None
    close_round = close_module.close_round
    coordinator.closer.close = timer.close(coordinator.closer.close)
    close_module.close_round = timer.aggregate(close_round)
    agreement = round_close.agreement
    round_close.agreement = timer.score(agreement)
    channel = grpc.insecure_channel(f"127.0.0.1:{running.grpc_port}", options=GRPC_OPTIONS)
    try:
        stub = pb_grpc.CoordinatorStub(channel)
        members = [join(stub, running, i, tiers[i % len(tiers)], submissions)
                   for i in range(clients)]
        play_round(stub, members, running.service.coordinator)  # warm-up
        walls, received, probes = [], [], {}
        for _ in range(args.rounds):
            round_index, seconds = play_round(stub, members, running.service.coordinator,
                                              probes)
            walls.append(seconds)
            record = running.service.coordinator.state.rounds[-1]
            assert record["round"] == round_index
            received.append(record["bytes_sent"])
        pids = [os.getpid(), *(p.pid for p in (coordinator.shards.processes
                                                if coordinator.shards else []))]
        memory = [process_memory_mib(pid) for pid in pids]  # before the reads below gather
        update_bytes, update_s, apply_s = fetch_and_apply(stub, members[0], coordinator,
                                                          round_index)
        one_pass = one_pass_s(coordinator.master)
        timed = timer.closes[1:]
        if any(c.clients != clients for c in timed):
            raise SystemExit(f"a round closed with {[c.clients for c in timed]} submissions, "
                             f"not {clients}; every client should submit every round.")
        dense = DENSE_BYTES_PER_VALUE * sum(math.prod(region_shape(r))
                                            for r in coordinator.regions(tiers[0]).values())
        up = sum(m.ByteSize() for m in members[0].messages)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
        return Row(clients, timed, walls, received, update_bytes, update_s, apply_s, one_pass,
                   probes, up, dense, rss, shards, [now for now, _ in memory],
                   [peak for _, peak in memory])
    finally:
        close_module.close_round = close_round
        round_close.agreement = agreement
        channel.close()
        running.stop()


def fetch_and_apply(stub: pb_grpc.CoordinatorStub, client: Client, coordinator: Coordinator,
                    round_index: int) -> tuple[int, float, float]:
    """A tier-0 client's download of one round's update and its application to a copy of
    the weights it holds: (bytes, seconds in all, seconds applying)."""
    regions = coordinator.regions(client.tier)
    weights = {name: coordinator.master[name][region_slices(region)].clone()
               for name, region in regions.items()}
    start = time.perf_counter()
    messages = list(stub.GetUpdates(pb.GetUpdatesRequest(since_round=round_index),
                                    metadata=client.auth))
    (update,) = read_updates(messages, tier=client.tier)
    applying = time.perf_counter()
    update.apply(weights, regions)
    end = time.perf_counter()
    return sum(m.ByteSize() for m in messages), end - start, end - applying


def process_memory_mib(pid: int) -> tuple[float, float]:
    """(resident, peak resident) MiB of process ``pid``, from /proc (Linux)."""
    fields = {}
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            fields[key] = value
    def mib(key: str) -> float:
        return int(fields[key].split()[0]) / 1024 if key in fields else NAN
    return mib("VmRSS"), mib("VmHWM")


def one_pass_s(master: dict[str, torch.Tensor], repeats: int = 5) -> float:
    """The median seconds of one pass over the master that reads and writes every float32
    element once (an in-place multiply of a copy): the unit the close and the apply are
    counted in (``close_passes``, ``apply_passes``)."""
    copies = [tensor.float().clone() for tensor in master.values()]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for tensor in copies:
            tensor.mul_(1.0)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def below_dense(f: dict[str, float]) -> float:
    """How many times less a client moves, up and down, than dense float32 both ways."""
    return (f["dense_bytes_up"] + f["dense_bytes_down"]) / (f["bytes_up"] + f["bytes_down"])


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    counts = [int(n) for n in args.clients.split(",")]
    submissions = Submissions(args)
    params = sum(torch.Size(s).numel() for s in submissions.shapes.values())
    print(
        f"torch {torch.__version__} | cpu, {torch.get_num_threads()} threads | hidden "
        f"{args.hidden_size}, {args.layers} layers, ffn {args.intermediate_size}, vocab "
        f"{args.vocab_size} | {params:,} params | {args.encoding}, chunk {args.chunk}, top "
        f"{args.topk}, values {args.value_dtype} | rule {args.rule}, momentum {args.momentum} | "
        f"tiers {args.tiers} | "
        f"median of {args.rounds} rounds | load average {os.getloadavg()[0]:.2f}"
    )
    with tempfile.TemporaryDirectory(prefix="matformer-bench-") as tmp:
        folder = Path(tmp)
        mdat = folder / "docs.mdat"
        build_default_mdat(mdat, limit=100).close()
        start = time.perf_counter()
        tiers = tiers_of(args)
        for i in range(max(counts)):  # encode outside every timed region
            submissions.messages(i, tiers[i % len(tiers)])
        print(f"encoded {max(counts)} clients' results in {time.perf_counter() - start:.1f} s")
        rows = [measure(args, n, folder, mdat, submissions, shards)
                for shards in [int(s) for s in args.shards.split(",")] for n in counts]
    print_table(
        ["clients", "close ms", "ms/client", "aggregate + step ms", "score ms", "hash ms",
         "log + save ms",
         "rest ms", "round wall ms", "hb p99 ms", "GetRound p99 ms"],
        [[str(r.clients), f"{r.close_s() * 1e3:,.1f}", f"{r.close_s() * 1e3 / r.clients:,.2f}",
          *(f"{r.close_s(s) * 1e3:,.1f}" for s in STEPS), f"{r.rest_s() * 1e3:,.1f}",
          f"{statistics.median(r.walls) * 1e3:,.0f}", f"{r.p99_ms('Heartbeat'):,.1f}",
          f"{r.p99_ms('GetRound'):,.1f}"] for r in rows],
    )
    figures = [r.figures() for r in rows]
    print()
    print_table(
        ["clients", "up KiB", "down KiB", "dense KiB", "x below dense", "apply s", "rss MiB",
         "1 pass ms", "close passes", "apply passes"],
        [[str(f["clients"]), f"{f['bytes_up'] / 2**10:,.1f}", f"{f['bytes_down'] / 2**10:,.1f}",
          f"{f['dense_bytes_up'] / 2**10:,.0f}", f"{below_dense(f):,.1f}",
          f"{f['update_apply_s']:,.2f}", f"{f['peak_rss_mib']:,.0f}",
          f"{f['one_pass_ms']:,.1f}", f"{f['close_passes']:,.0f}", f"{f['apply_passes']:,.0f}"]
         for f in figures],
    )
    below = min(below_dense(f) for f in figures)
    worst_p99 = max(f["heartbeat_p99_ms"] for f in figures)
    print(f"targets: up + down >= 100x below dense at every N: {below:,.1f}x "
          f"({'met' if below >= 100 else 'not met'}); heartbeat p99 <= 50 ms: "
          f"{worst_p99:,.1f} ms ({'met' if worst_p99 <= 50 else 'not met'})")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
        print(f"wrote {args.json}")
    one = [r for r in rows if r.shards == 1] or rows
    first, last = one[0], one[-1]
    growth = last.close_s() / first.close_s()
    print(f"close at {last.clients} clients / at {first.clients}: {growth:.2f} "
          f"(target <= 3 at 64 / 1: {'met' if growth <= 3 else 'not met'})")
    marginal = [f"{a.clients}->{b.clients}: "
                f"{(b.close_s() - a.close_s()) * 1e3 / (b.clients - a.clients):,.2f}"
                for a, b in itertools.pairwise(one)]
    print(f"close ms per added client: {', '.join(marginal)} (flat or falling: linear)")
    if len({r.shards for r in rows}) > 1:
        print_shards(rows)


def print_shards(rows: list[Row]) -> None:
    """The sharded close against one process at each client count (issue 48: with 2 shards
    on 2 cores the close at most 0.6x one shard's, each shard's memory about half)."""
    base = {r.clients: r for r in rows if r.shards == 1}
    print()
    print_table(
        ["shards", "clients", "close ms", "x 1 shard", "RSS MiB per process (now)",
         "peak RSS MiB per process"],
        [[str(r.shards), str(r.clients), f"{r.close_s() * 1e3:,.1f}",
          f"{r.close_s() / base[r.clients].close_s():.2f}" if r.clients in base else "-",
          " / ".join(f"{m:,.0f}" for m in r.shard_rss_mib),
          " / ".join(f"{m:,.0f}" for m in r.shard_peak_rss_mib)] for r in rows])

if __name__ == "__main__":
    main()
