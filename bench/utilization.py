"""How busy do members stay? The share of its wall time each member computes, round after round.

For each case (N members, seconds of compute per round) a real ``matformer-server`` starts
on loopback (``RunningServer.start``) in a process of its own, as on a coordinator's host
(``--server thread``: in this process, as ``scale.py`` runs it), and this process drives N
simulated members, each in its own thread, through ``client.connection.Connection``, the
client's real transport edge, with its simulated link (``--latency-ms`` before every call,
``--bandwidth-mbit`` each way, per member). A member plays today's client loop (``play``):
GetRound; on new work, the updates of the rounds it lacks (GetUpdates) and its sequences
(FetchSequences); its compute, with heartbeats beside it; SubmitResult. Its compute is a
fixed busy time: a sleep of its assigned tokens over its speed. Speeds cycle 1, 1/2, 1/4
(member i asks for tier i % 3, so the slowest hold the smallest tier) and are set so that a
speed-1 member's share of a round takes ``--compute`` seconds; each member reports its speed
in a heartbeat once joined and as ``train_seconds`` with every result, so the coordinator's
split gives each a share in proportion to its speed. Results have the real size of the
shape: one set per tier, made once beforehand (``scale.Submissions``, a random gradient
through error feedback) and sent every round with the round's token count; downloads are the
coordinator's real updates (read, not applied to a model).

Per member, over the timed rounds (after the warm-up ones: one synchronous, three
overlapped, so that every timed round is split by the speeds members showed in a delivered
round; ``warmup_rounds``): ``utilization``, its seconds of compute over the wall seconds
from the start of its compute in the first timed round to the start of its compute in the
round after the last (each member's own window: one of every step per round).
``rpcs/round``: the calls it made in that window, counted by name at its channel (retries
and heartbeats too), per round; the mean over members. ``rounds/min`` over the median
member's window. ``close ms``: from the round records (the status snapshot), the median over
timed rounds of ``close_s``: from the round's handing over to its close (its last result in)
to its record (aggregate, step, hash, log). While the timed rounds run, ``--beside``
CPU-bound processes (``while True: pass``) run beside the server, and two prober threads, on
the sessions of the first and the last member, send Heartbeat and GetRound in turn over
their own loopback channel (``scale.probing``): ``hb p99`` is the 99th percentile of
Heartbeat's answers, ``hb max`` the slowest. A prober waits for each answer, so a call that
stalls (the one that runs a close, in today's coordinator) is one sample however long it
takes; the other prober samples on meanwhile, and ``hb max`` shows the stall. The members
and the probers share this process (and its GIL); the server has its own unless ``--server
thread``. All of them, and the CPU-bound processes, share the machine's cores.

``--json OUT`` writes one object per case: ``clients``, ``compute_s_per_round``,
``utilization_min``, ``utilization_median``, ``rounds_per_min``, ``rpcs_per_round``,
``heartbeat_p99_ms``, ``close_ms`` (and ``rounds``, ``rpcs_by_name``, ``seconds_per_round``
by step, ``heartbeat_max_ms``, ``getround_p99_ms``). Targets (issue 31): ``utilization_min``
>= 0.90 at 10 s per round and >= 0.80 at 2 s; ``heartbeat_p99_ms`` <= 50.

    python bench/utilization.py --smoke          # 2 members, micro model, 0.2 s rounds, both
                                                 # loops, nothing beside: it runs
    python bench/utilization.py                  # tiny model: 4 and 16 members, 2 and 10 s
    python bench/utilization.py --shape 150m --clients 4 --json runs/utilization.json
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Connection as PipeEnd
from pathlib import Path
from typing import Any

import grpc
import torch
from harness import parse, print_table
from scale import JOIN_TOKEN, Submissions, probing, run_config, tiers_of
from scale import SHAPES as NAMED_SHAPES

from matformer.client.connection import Connection, Finished, Train, Wait
from matformer.modeling.compression import CompressionConfig, SparseResult
from matformer.modeling.mdat import build_default_mdat
from matformer.protocol.channel import GRPC_OPTIONS
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.server.config import RunConfig
from matformer.server.main import RunningServer
from matformer.server.pipeline import WINDOW

# tiny: scale.py's default shape (4M parameters); micro: --smoke's (0.2M)
SHAPES = {"tiny": {"vocab_size": 260, "hidden_size": 256, "layers": 4, "heads": 4,
                   "kv_heads": 2, "intermediate_size": 1024},
          "micro": {"vocab_size": 260, "hidden_size": 64, "layers": 2, "heads": 4,
                    "kv_heads": 2, "intermediate_size": 256}, **NAMED_SHAPES}
SPEEDS = (1.0, 0.5, 0.25)  # member i computes at SPEEDS[i % 3] of a speed-1 member's rate
# Warm-up rounds before the timed ones: every timed round is split by the speeds members
# showed in a round they delivered (a speed claimed at Join counts only up to the typical
# one: server.pipeline.trusted_speeds). Synchronous rounds open one after another, so round
# 1 is; overlapped ones open WINDOW ahead, so round WINDOW is the first.
def warmup_rounds(overlap: bool) -> int:
    return WINDOW if overlap else 1
TARGETS = {10.0: 0.90, 2.0: 0.80}  # compute s per round → utilization_min asked for
HEARTBEAT_P99_MS = 50.0
MIN_WAIT_S = 0.05  # the shortest pause between GetRound polls, as the client's
UPDATE_WAIT_S = 20.0  # how long one GetUpdates may wait for a round to close, as the client's
LOSS = 3.0
SERVER_PLACES = {"process": "its own process", "thread": "this process"}  # --server
STOP = "stop"  # tells the coordinator's process to stop serving
SERVER_ANSWER_S = 120.0  # the longest the coordinator's process may take to start or answer
NAN = float("nan")
# a CPU-bound process that ends when its parent does (it looks up every few 10 ms)
SPIN = ("import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n"
        "    for _ in range(10**6): pass\n")
SMOKE = {"shape": "micro", "clients": "2", "compute": "0.2", "rounds": 2, "overlap": "both",
         "latency_ms": 5.0, "beside": 0, "threads": 1}
# what scale.run_config and scale.Submissions read that this benchmark does not vary
FIXED = {"seq_len": 128, "tiers": "0,1,2", "rule": "sign", "momentum": 0.0,
         "broadcast_topk": None, **{key: getattr(CompressionConfig(), key)
                                    for key in ("encoding", "chunk", "topk", "value_dtype")}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                        help="micro: 0.2M parameters; tiny: 4M; 150m: 162M (hidden 768, "
                             "12 layers, FFN 3072, vocab 32000)")
    parser.add_argument("--clients", default="4,16", help="member counts, comma-separated")
    parser.add_argument("--compute", default="2,10",
                        help="seconds of compute per round of a speed-1 member, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per case")
    parser.add_argument("--overlap", choices=("on", "off", "both"), default="on",
                        help="[round] overlap of the run and the member loop that goes with "
                             "it (off: synchronous rounds, as before issue 31)")
    parser.add_argument("--latency-ms", type=float, default=50.0,
                        help="added before every call of a member")
    parser.add_argument("--bandwidth-mbit", type=float, default=20.0,
                        help="each way, per member (0: no limit)")
    parser.add_argument("--sequences-per-client", type=int, default=16,
                        help="round token budget = members x this x 128 tokens (finer shares)")
    parser.add_argument("--beside", type=int, default=1,
                        help="CPU-bound processes running beside the server in timed rounds")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--server", choices=sorted(SERVER_PLACES), default="process",
                        help="the coordinator in a process of its own (as on its own host), "
                             "or in a thread of the members' process")
    parser.add_argument("--json", type=Path, default=None, help="write the figures per case")
    parser.set_defaults(**FIXED)
    args = parse(parser, SMOKE, argv)
    for key, value in SHAPES[args.shape].items():
        setattr(args, key, value)
    try:
        args.counts = [int(n) for n in args.clients.split(",")]
        args.computes = [float(s) for s in args.compute.split(",")]
    except ValueError:
        parser.error(f"--clients {args.clients!r} / --compute {args.compute!r}: give whole "
                     "numbers of members and seconds, comma-separated (4,16 and 2,10).")
    if min(args.counts) < 1 or not min(args.computes) > 0 or args.rounds < 1:
        parser.error("--clients, --compute and --rounds must be positive.")
    return args


class CallCounter(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Every call made over a channel, by RPC name (a retry is a call)."""

    def __init__(self) -> None:
        self._calls: Counter[str] = Counter()
        self._lock = threading.Lock()  # the heartbeat thread calls beside the member's

    def _intercept(self, continuation: Any, details: Any, request: Any) -> Any:
        with self._lock:
            self._calls[details.method.rpartition("/")[2]] += 1
        return continuation(details, request)

    intercept_unary_unary = intercept_unary_stream = _intercept
    intercept_stream_unary = intercept_stream_stream = _intercept

    def snapshot(self) -> Counter[str]:
        with self._lock:
            return Counter(self._calls)

    def count(self, connection: Connection) -> None:
        """Count ``connection``'s calls (at its channel, below its retries)."""
        connection.channel = grpc.intercept_channel(connection.channel, self)
        connection.stub = pb_grpc.CoordinatorStub(connection.channel)


@dataclass(frozen=True, slots=True)
class Mark:
    """A member's counters as its compute of ``round`` began."""

    round: int
    at: float  # perf_counter
    calls: Counter[str]  # calls made so far, by RPC name
    seconds: Counter[str]  # seconds so far: in each RPC, "compute", "wait" (GetRound's pauses)


@dataclass(slots=True)
class Member:
    """One simulated member: its link to the coordinator, its speed and its records."""

    connection: Connection
    client_id: str
    tier: int
    speed: float  # tokens per second of its compute
    results: list[SparseResult]  # its tier's results, sent every round with the round's count
    calls: CallCounter
    spent: Counter[str] = field(default_factory=Counter)  # "compute", "wait" → seconds
    marks: list[Mark] = field(default_factory=list)
    warmup: int = 1  # rounds before the timed ones

    def mark(self, round_index: int) -> None:
        seconds = self.spent + Counter(self.connection.call_seconds)
        self.marks.append(Mark(round_index, time.perf_counter(), self.calls.snapshot(), seconds))

    def window(self) -> tuple[Mark, Mark]:
        """The first mark of a timed round and the last one."""
        first = next(m for m in self.marks if m.round >= self.warmup)
        return first, self.marks[-1]


def play(member: Member, last_round: int) -> None:
    """Today's member loop (``client/federated.py``'s, with a sleep for its training) until
    it would compute ``last_round``: GetRound; a reply ahead of the updates it holds fetches
    them (GetUpdates); new work is trained (``train``)."""
    connection, applied = member.connection, 0
    while True:
        work = connection.get_round()
        if work.round > applied:
            updates = connection.updates(applied, member.tier)
            applied = updates[-1].round + 1 if updates else applied
        match work:
            case Finished():
                return
            case Wait() if work.round >= last_round:  # no share of the last round
                member.mark(work.round)
                return
            case Wait():
                pause = max(work.retry_after_s, MIN_WAIT_S)
                time.sleep(pause)
                member.spent["wait"] += pause
            case Train() if work.round != applied:
                continue  # the log lags the round that opened; ask again
            case Train():
                if not train(member, work, last_round):
                    return


def play_overlapped(member: Member, last_round: int) -> None:
    """The overlapped member loop (``client/rounds.py``'s ``OverlappedRounds``, with a sleep
    for its training) until it would compute ``last_round``. Round r computes once the
    updates through round r - 2 are in; its upload, the next assignments' sequences and the
    updates the next round needs (GetUpdates held until that round closes) move beside the
    compute, uploads, sequences and updates each on a thread. The time the loop waits for them
    counts as "wait"."""
    connection, held, fetching = member.connection, deque[Train](), {}
    uploads = ThreadPoolExecutor(1, thread_name_prefix=f"uploads-{member.client_id}")
    fetches = ThreadPoolExecutor(1, thread_name_prefix=f"sequences-{member.client_id}")
    downloads = ThreadPoolExecutor(1, thread_name_prefix=f"updates-{member.client_id}")
    upload: Future | None = None
    asked: Future | None = None
    applied, trained = 0, -1

    def waited(future: Future) -> Any:
        start = time.perf_counter()
        try:
            return future.result()
        finally:
            member.spent["wait"] += time.perf_counter() - start

    def hold(assignments: list[Train]) -> None:
        known = {w.assignment_id for w in held}
        for work in assignments:
            if work.round > trained and work.assignment_id not in known:
                held.append(work)
                fetching[work.assignment_id] = fetches.submit(connection.fetch_sequences,
                                                                work.sequence_ids)

    try:
        with connection.keep_alive(lambda: max(trained, 0)):
            while True:
                if not held and upload is not None:
                    hold(waited(upload).assignments)
                    upload = None
                if not held:
                    work = connection.get_round(after=trained if trained >= 0 else None)
                    match work:
                        case Finished():
                            return
                        case Wait() if work.round >= last_round:
                            member.mark(work.round)
                            return
                        case Wait():
                            pause = max(work.retry_after_s, MIN_WAIT_S)
                            time.sleep(pause)
                            member.spent["wait"] += pause
                        case Train():
                            hold([work])
                    continue
                work = held.popleft()
                while applied < work.round - 1:  # the weights after work.round - 1 rounds
                    if asked is None:
                        asked = downloads.submit(connection.updates, applied, member.tier,
                                                 wait_s=UPDATE_WAIT_S)
                    updates, asked = waited(asked), None
                    applied = max(applied, updates[-1].round + 1) if updates else applied
                if asked is None and work.round >= 1:  # the next round's: closes meanwhile
                    asked = downloads.submit(connection.updates, work.round - 1, member.tier,
                                             wait_s=UPDATE_WAIT_S)
                sequences = waited(fetching.pop(work.assignment_id))
                member.mark(work.round)
                if work.round >= last_round:
                    return
                tokens = sum(len(s) for s in sequences)
                busy_s = tokens / member.speed
                start = time.perf_counter()
                time.sleep(busy_s)
                member.spent["compute"] += time.perf_counter() - start
                trained = work.round
                if upload is not None:
                    hold(waited(upload).assignments)
                upload = uploads.submit(
                    connection.submit, work, client_id=member.client_id, tokens=tokens,
                    loss=LOSS, train_seconds=busy_s,
                    results=[dataclasses.replace(r, tokens=tokens) for r in member.results])
    finally:
        for pool in (uploads, fetches, downloads):
            pool.shutdown(wait=True, cancel_futures=True)


def train(member: Member, work: Train, last_round: int) -> bool:
    """One round's work, heartbeats beside: its sequences (FetchSequences), the mark of its
    compute's start, then (before ``last_round``; else False) the compute, a sleep of its
    tokens at the member's speed, and its results (SubmitResult)."""
    connection = member.connection
    with connection.keep_alive(lambda: work.round):
        sequences = connection.fetch_sequences(work.sequence_ids)
        member.mark(work.round)
        if work.round >= last_round:
            return False
        tokens = sum(len(s) for s in sequences)
        busy_s = tokens / member.speed
        start = time.perf_counter()
        time.sleep(busy_s)
        member.spent["compute"] += time.perf_counter() - start
        connection.submit(
            work, client_id=member.client_id, tokens=tokens, loss=LOSS, train_seconds=busy_s,
            results=[dataclasses.replace(r, tokens=tokens) for r in member.results])
    return True


@contextlib.contextmanager
def cpu_bound(processes: int) -> Iterator[None]:
    """``processes`` Python processes spinning on a core each while the block runs: the
    other work a real coordinator's host has. Each also ends once this process is gone."""
    spinning = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(processes)]
    try:
        yield
    finally:
        for process in spinning:
            process.kill()
            process.wait()


@dataclass(slots=True)
class Case:
    clients: int
    compute_s: float
    overlap: bool
    members: list[Member]
    probes: dict[str, list[float]]  # RPC → seconds of each probe's answer
    close_s: list[float]  # per timed round

    def utilizations(self) -> list[float]:
        return [(b.seconds["compute"] - a.seconds["compute"]) / (b.at - a.at)
                for a, b in (m.window() for m in self.members)]

    def per_round(self, of: str) -> dict[str, float]:
        """Calls (``of="calls"``) or seconds by name per round, the mean over members."""
        totals: Counter[str] = Counter()
        for a, b in (m.window() for m in self.members):
            for name, value in (getattr(b, of) - getattr(a, of)).items():
                totals[name] += value / (b.round - a.round) / len(self.members)
        return dict(sorted(totals.items()))

    def probe_ms(self, rpc: str, quantile: float = 0.99) -> float:
        """A quantile of the probes' answers to ``rpc`` (1: the slowest)."""
        times = sorted(self.probes.get(rpc, []))
        return times[min(len(times) - 1, int(quantile * len(times)))] * 1e3 if times else NAN

    def figures(self) -> dict[str, Any]:
        """The JSON keys of one case."""
        used = self.utilizations()
        windows = [m.window() for m in self.members]
        rounds = statistics.median_low(b.round - a.round for a, b in windows)
        wall = statistics.median(b.at - a.at for a, b in windows)
        calls = self.per_round("calls")
        return {"clients": self.clients, "compute_s_per_round": self.compute_s,
                "overlap": self.overlap,
                "utilization_min": min(used), "utilization_median": statistics.median(used),
                "rounds_per_min": 60 * rounds / wall, "rpcs_per_round": sum(calls.values()),
                "heartbeat_p99_ms": self.probe_ms("Heartbeat"),
                "close_ms": statistics.median(self.close_s) * 1e3 if self.close_s else NAN,
                "rounds": rounds, "rpcs_by_name": calls,
                "seconds_per_round": self.per_round("seconds"),
                "heartbeat_max_ms": self.probe_ms("Heartbeat", 1.0),
                "getround_p99_ms": self.probe_ms("GetRound")}


def join(address: str, args: argparse.Namespace, run_id: str, index: int, speed: float,
         results: dict[int, list[SparseResult]]) -> Member:
    """Member ``index`` joins (asking for tier ``index % 3``) and reports its speed."""
    connection = Connection(address, latency_s=args.latency_ms / 1000,
                            bandwidth_mbit=args.bandwidth_mbit)
    calls = CallCounter()
    calls.count(connection)
    tiers = tiers_of(args)
    joined = connection.join(
        name=f"member-{index}", run_id=run_id, join_token=JOIN_TOKEN, device_kind="cpu",
        device_name="simulated", memory_bytes=2**40, load_strategy="auto",
        microbatch_tokens=args.seq_len, tier=tiers[index % len(tiers)])
    connection.heartbeat(joined.round, tokens_per_second=speed)
    return Member(connection, joined.client_id, joined.tier, speed, results[joined.tier], calls)


def measure(args: argparse.Namespace, clients: int, compute_s: float, overlap: bool,
            folder: Path, mdat: Path, results: dict[int, list[SparseResult]]) -> Case:
    folder = folder / f"{clients}-members-{compute_s:g}-s-{'overlap' if overlap else 'sync'}"
    folder.mkdir()
    warmup = warmup_rounds(overlap)
    config = run_config(args, clients, folder, mdat)
    # the warm-up rounds, the timed ones, and one more so that no timed round ends the run
    config = dataclasses.replace(config, round=dataclasses.replace(
        config.round, overlap=overlap, rounds=warmup + args.rounds + 1))
    relative = [SPEEDS[i % len(SPEEDS)] for i in range(clients)]
    # a speed-1 member's share of the round's tokens takes compute_s
    unit = config.round.tokens_per_round / (sum(relative) * compute_s)
    server = (ServerProcess if args.server == "process" else ServerThread)(config, args.threads)
    address = f"127.0.0.1:{server.grpc_port}"
    pool = ThreadPoolExecutor(clients, thread_name_prefix="member")
    members: list[Member] = []
    probes: dict[str, list[float]] = {}
    try:
        members = [join(address, args, config.run.id, i, unit * relative[i], results)
                   for i in range(clients)]
        loop = play_overlapped if overlap else play
        for member in members:
            member.warmup = warmup
        playing = [pool.submit(loop, m, warmup + args.rounds) for m in members]
        warming_up(server, playing, warmup)
        with grpc.insecure_channel(address, options=GRPC_OPTIONS) as channel:  # the probers'
            stub = pb_grpc.CoordinatorStub(channel)
            with (cpu_bound(args.beside), probing(stub, members[0].connection.metadata, probes),
                  probing(stub, members[-1].connection.metadata, probes)):
                for future in playing:
                    future.result()
        records = server.snapshot(since_round=warmup)["rounds"]
        close_s = [r["close_s"] for r in records if r["round"] < warmup + args.rounds]
        return Case(clients, compute_s, overlap, members, probes, close_s)
    finally:
        server.stop()  # a member still waiting gives up (Unreachable) once it is gone
        pool.shutdown()
        for member in members:
            member.connection.close()


def warming_up(server: ServerThread | ServerProcess, playing: list[Future], warmup: int
               ) -> None:
    """Returns once the ``warmup`` rounds have closed (or a member failed)."""
    while server.snapshot(since_round=None)["round"] < warmup and not any(
            f.done() for f in playing):
        time.sleep(0.1)


class ServerThread:
    """The coordinator in this process: ``RunningServer`` and its status snapshot."""

    def __init__(self, config: RunConfig, threads: int | None) -> None:
        self.running = RunningServer.start(config, grpc_port=0, http_port=0)
        self.grpc_port = self.running.grpc_port

    def snapshot(self, since_round: int | None) -> dict[str, Any]:
        return self.running.service.coordinator.snapshot(since_round=since_round,
                                                         events_after=None)

    def stop(self) -> None:
        self.running.stop()


class ServerProcess:
    """The coordinator in a process of its own (``serve``), asked for its status snapshot
    over a pipe."""

    def __init__(self, config: RunConfig, threads: int | None) -> None:
        context = multiprocessing.get_context("spawn")
        self.pipe, theirs = context.Pipe()
        self.process = context.Process(target=serve, args=(config, threads, theirs),
                                       name="coordinator", daemon=True)
        self.process.start()
        theirs.close()
        self.grpc_port = self._answer()

    def snapshot(self, since_round: int | None) -> dict[str, Any]:
        self.pipe.send(since_round)
        return self._answer()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.pipe.send(STOP)
        self.process.join(timeout=60)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def _answer(self) -> Any:
        if not self.pipe.poll(SERVER_ANSWER_S):
            raise TimeoutError(f"the coordinator's process did not answer in {SERVER_ANSWER_S} s")
        answer = self.pipe.recv()
        if isinstance(answer, BaseException):
            raise answer
        return answer


def serve(config: RunConfig, threads: int | None, pipe: PipeEnd) -> None:
    """(the coordinator's process) Serve ``config`` and answer snapshot requests (a round
    index or None) until told to STOP or the pipe closes."""
    if threads:
        torch.set_num_threads(threads)
    try:
        running = RunningServer.start(config, grpc_port=0, http_port=0)
    except Exception as err:
        pipe.send(err)
        return
    pipe.send(running.grpc_port)
    try:
        while True:
            try:
                asked = pipe.recv()
            except EOFError:
                return
            if asked == STOP:
                return
            pipe.send(running.service.coordinator.snapshot(since_round=asked, events_after=None))
    finally:
        running.stop()


def verdict(value: float, met: bool) -> str:
    return f"{value:.2f} ({'met' if met else 'not met'})"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    submissions = Submissions(args)
    params = sum(torch.Size(s).numel() for s in submissions.shapes.values())
    print(f"torch {torch.__version__} | cpu, {torch.get_num_threads()} threads | {args.shape}: "
          f"{params:,} params | links {args.latency_ms:g} ms, {args.bandwidth_mbit:g} Mbit each "
          f"way | speeds {', '.join(f'{s:g}' for s in SPEEDS)} | {args.beside} CPU-bound "
          f"process(es) beside | server in {SERVER_PLACES[args.server]} | {args.rounds} timed "
          f"rounds | load average "
          f"{os.getloadavg()[0]:.2f}")
    start = time.perf_counter()
    results = {tier: submissions.results(tier, tier) for tier in tiers_of(args)}
    print(f"made each tier's results in {time.perf_counter() - start:.1f} s")
    cases = []
    with tempfile.TemporaryDirectory(prefix="matformer-bench-") as tmp:
        folder = Path(tmp)
        mdat = folder / "docs.mdat"
        build_default_mdat(mdat, limit=100).close()
        modes = {"on": [True], "off": [False], "both": [False, True]}[args.overlap]
        for n in args.counts:
            for compute_s in args.computes:
                for overlap in modes:
                    cases.append(measure(args, n, compute_s, overlap, folder, mdat, results))
                    f = cases[-1].figures()
                    print(f"{n} members, {compute_s:g} s, overlap {'on' if overlap else 'off'}: "
                          f"utilization min {f['utilization_min']:.2f}, median "
                          f"{f['utilization_median']:.2f}", flush=True)
    figures = [c.figures() for c in cases]
    print()
    print_table(
        ["clients", "compute s", "overlap", "util min", "util median", "rounds/min", "rpcs/round",
         "hb p99 ms", "hb max ms", "GetRound p99 ms", "close ms"],
        [[str(f["clients"]), f"{f['compute_s_per_round']:g}", "on" if f["overlap"] else "off",
          f"{f['utilization_min']:.2f}",
          f"{f['utilization_median']:.2f}", f"{f['rounds_per_min']:.2f}",
          f"{f['rpcs_per_round']:.1f}", f"{f['heartbeat_p99_ms']:,.1f}",
          f"{f['heartbeat_max_ms']:,.1f}", f"{f['getround_p99_ms']:,.1f}",
          f"{f['close_ms']:,.0f}"] for f in figures])
    print()
    steps = ["compute", "SubmitResult", "GetUpdates", "FetchSequences", "GetRound", "wait"]
    print("a member's round, mean seconds (GetRound includes polls; wait: pauses between them; "
          "heartbeats run beside the compute)")
    print_table(["clients", "compute s", "overlap", *steps],
                [[str(f["clients"]), f"{f['compute_s_per_round']:g}",
                  "on" if f["overlap"] else "off",
                  *(f"{f['seconds_per_round'].get(s, 0.0):.2f}" for s in steps)]
                 for f in figures])
    for f in figures:
        calls = ", ".join(f"{name} {n:.1f}" for name, n in f["rpcs_by_name"].items())
        print(f"calls per round per member at {f['clients']}, {f['compute_s_per_round']:g} s, "
              f"overlap {'on' if f['overlap'] else 'off'}: {calls}")
    print()
    for f in figures:
        target = TARGETS.get(f["compute_s_per_round"])
        if target is not None and f["overlap"]:
            print(f"target: utilization_min >= {target:.2f} at {f['clients']} members, "
                  f"{f['compute_s_per_round']:g} s: "
                  f"{verdict(f['utilization_min'], f['utilization_min'] >= target)}")
    worst = max(f["heartbeat_p99_ms"] for f in figures)
    print(f"target: heartbeat_p99_ms <= {HEARTBEAT_P99_MS:g}: "
          f"{verdict(worst, worst <= HEARTBEAT_P99_MS)}; the slowest heartbeat took "
          f"{max(f['heartbeat_max_ms'] for f in figures):,.1f} ms")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
