"""Where one coordinator stops keeping up: rounds, its close, CPU, memory, bytes and heartbeats
as the members grow from 16 to 1,024 (issue 35; docs/scaling.md reads these figures).

For each member count N a real coordinator serves on loopback in a process of its own
(``utilization.ServerProcess``: ``RunningServer.start``, as ``matformer server`` runs it),
pinned to the first core when the machine has more than one, and N simulated members run in
this process, on the other cores, on one asyncio loop with a gRPC channel each. A member
trains nothing but makes the calls of one and moves the bytes of one: it joins asking for
tier ``i % 3``, heartbeats every [faults] heartbeat_s on its own schedule (first beat at a
random phase), and per round asks GetRound, downloads its sequences (FetchSequences),
uploads results the size of its tier's (a random gradient through error feedback and the
run's compression, made once per tier before any timing: ``scale.Submissions``) and waits
for the round's update with GetUpdates, as the client does.

Figures per N, over the timed rounds (after one warm-up round):

- ``rounds_per_min``: rounds closed per minute of wall time;
- ``close_ms``: the median close, from the coordinator's own round records (``close_s``:
  the last result or the deadline, to the update's record);
- ``coordinator_cpu_s_per_round``: the coordinator process's user + system CPU seconds per
  round (``/proc/PID/stat``), every thread of it;
- ``coordinator_rss_mib``: its peak resident memory (``VmHWM``);
- ``bytes_in_per_round`` and ``bytes_out_per_round``: every byte the members sent to and
  received from the coordinator per round, heartbeats included, counted as each message's
  protobuf size plus gRPC's 5-byte frame (HTTP/2 and TCP headers not counted);
- ``heartbeat_p99_ms``: the 99th percentile of the members' heartbeat round trips.

Beside them: ``heartbeat_max_ms`` (the slowest heartbeat), ``failed_calls`` (calls that
failed with a transient status and were made again, by status) and ``failed_details`` (the
first failure's message of each), ``join_s`` (until all N members had joined), ``timed_s``
(the timed rounds' wall time), ``case_s`` (the whole case, server start to stop) and
``coordinator_threads`` (its threads after the timed rounds: gRPC's worker pool never
shrinks, so this is its peak).

With ``--free-riders F`` each count runs twice: as above, then with F more members that
join, heartbeat and take work (GetRound, FetchSequences) but never submit, as a free rider
does; ``rounds/min with free riders / without`` compares the two (issue 47: at least 0.8).
The warm-up round holds their first miss, which waits the whole ``--deadline-s``; the
coordinator then no longer waits for them and excludes them after [faults] max_misses.

With ``--relays R`` the members join through R relays (``matformer relay``, a process each
on the members' cores), spread evenly, each member with positions of its own (its tier's
results, each chunk's positions moved by a shift of its own: within a relay no two members
send the same positions, the worst case for a partial sum). ``root_bytes_in_per_round`` and
``root_bytes_out_per_round`` are what the coordinator itself counted from and to its members
(submissions in; updates, sequences and checkpoint files out): the relays', with relays.
``relays_cpu_s_per_round`` is the relays' CPU together. ``--relay-topk K`` passes the
relays ``--topk K`` (0: exact partial sums).

The members' own CPU share is printed beside (``members cpu``): on a small machine the
members, not the coordinator, can be what limits the rate, and the coordinator's CPU per
round is the figure that carries to a real deployment.

    python bench/many_members.py --smoke    # 2 and 4 members through a relay, micro model: it runs
    python bench/many_members.py --json runs/many.json           # tiny (4M): 16 ... 1,024
    python bench/many_members.py --shape 150m --members 16,64 --json runs/many-150m.json
    python bench/many_members.py --members 256 --relays 8 --json runs/many-relays.json
    python bench/many_members.py --members 2 --free-riders 8 --rounds 8 --deadline-s 10 \
        --train-s 2
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import resource
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc
import torch
from harness import parse, print_table
from scale import JOIN_TOKEN, RELAY_TOKEN, Submissions, run_config, tiers_of
from utilization import SHAPES, ServerProcess

from matformer.local_testnet.processes import (
    Child,
    child_env,
    free_port,
    python_module,
    wait_serving,
)
from matformer.modeling.compression import ChunkGrid
from matformer.modeling.mdat import build_default_mdat
from matformer.protocol.auth import session_metadata
from matformer.protocol.channel import GRPC_OPTIONS
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.protocol.sparse import encode_sparse_result
from matformer.protocol.submission import result_batches
from matformer.protocol.tensors import decode_tensor, encode_tensor
from matformer.server.call_slots import CallLimits
from matformer.server.config import RunConfig

FRAME = 5  # gRPC's length prefix before every message
WARMUP_ROUNDS = 1
UPDATE_WAIT_S = 20.0  # one GetUpdates may wait this long for a round to close, as the client's
MIN_WAIT_S = 0.05  # the shortest pause between GetRound polls, as the client's
# the smoke pass goes through a relay: every line the direct path runs, and the relays' too
SMOKE = {"shape": "micro", "members": "2,4", "rounds": 1, "heartbeat_s": 1.0, "threads": 1,
         "relays": 1}
# what scale.run_config and scale.Submissions read that this benchmark does not vary
FIXED = {"seq_len": 128, "tiers": "0,1,2", "rule": "sign", "momentum": 0.0,
         "broadcast_topk": None, "encoding": "dct", "chunk": 64, "topk": 32,
         "value_dtype": "bfloat16"}
T = TypeVar("T")
KEYS = ("members", "rounds_per_min", "close_ms", "coordinator_cpu_s_per_round",
        "coordinator_rss_mib", "bytes_in_per_round", "bytes_out_per_round", "heartbeat_p99_ms")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny",
                        help="micro: 0.2M parameters; tiny: 4M; 150m: 162M")
    parser.add_argument("--members", default="16,64,256,1024",
                        help="member counts, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per count")
    parser.add_argument("--sequences-per-client", type=int, default=2,
                        help="round token budget = members x this x 128 tokens")
    parser.add_argument("--heartbeat-s", type=float, default=5.0,
                        help="[faults] heartbeat_s: each member's heartbeat interval")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--relays", type=int, default=0, metavar="R",
                        help="the members join through R relays (matformer relay, a process "
                             "each), spread evenly; 0: they join the coordinator")
    parser.add_argument("--relay-topk", type=int, default=0, metavar="K",
                        help="the relays' --topk: 0 hands the root the exact partial sums")
    parser.add_argument("--free-riders", type=int, default=0, metavar="F",
                        help="also run each count with F more members that take work and "
                             "never deliver")
    parser.add_argument("--train-s", type=float, default=0.0,
                        help="each member's training of a round, simulated (a sleep); 0: none, "
                             "the calls alone")
    parser.add_argument("--deadline-s", type=float, default=None,
                        help="[round] deadline_s (default: scale's, an hour)")
    parser.add_argument("--beats", choices=("door", "in-process"), default="door",
                        help="door: heartbeats answered by the coordinator's heartbeat "
                             "process ([server] heartbeat_port = 0); in-process: by its "
                             "gRPC server, with every other call")
    parser.add_argument("--json", type=Path, default=None, help="write the figures per count")
    parser.set_defaults(**FIXED)
    args = parse(parser, SMOKE, argv)
    for key, value in SHAPES[args.shape].items():
        setattr(args, key, value)
    try:
        args.counts = [int(n) for n in args.members.split(",")]
    except ValueError:
        parser.error(f"--members {args.members!r}: give whole numbers, comma-separated.")
    if min(args.counts) < 1 or args.rounds < 1:
        parser.error("--members and --rounds must be positive.")
    if args.relays < 0 or args.relays > min(args.counts):
        parser.error("--relays must lie in [0, the smallest member count].")
    return args


def many_config(args: argparse.Namespace, members: int, folder: Path, mdat: Path) -> RunConfig:
    """``scale.run_config`` for ``members`` that stay a whole run: room for all of them, and
    heartbeats on their schedule."""
    config = run_config(args, members, folder, mdat)
    if args.deadline_s is not None:
        config = dataclasses.replace(config, round=dataclasses.replace(
            config.round, deadline_s=args.deadline_s))
    if args.relays:  # the root's members are the relays
        config = dataclasses.replace(config, round=dataclasses.replace(
            config.round, min_clients=args.relays))
    faults = dataclasses.replace(
        config.faults, heartbeat_s=args.heartbeat_s, heartbeat_timeout_s=600.0,
        max_members=max(members, config.faults.max_members),
        max_streams=min(1024, max(members, config.faults.max_streams)),
        stream_idle_s=600.0, request_idle_s=600.0)
    rounds = dataclasses.replace(config.round, rounds=WARMUP_ROUNDS + args.rounds + 1)
    server = dataclasses.replace(config.server,
                                 heartbeat_port=0 if args.beats == "door" else None)
    return dataclasses.replace(config, faults=faults, round=rounds, server=server)


@dataclasses.dataclass(slots=True)
class Traffic:
    """Bytes both ways, and heartbeat round trips, of every member together."""

    sent: int = 0
    received: int = 0
    heartbeats: list[float] = dataclasses.field(default_factory=list)
    failed: Counter[str] = dataclasses.field(default_factory=Counter)  # status → calls
    why: dict[str, str] = dataclasses.field(default_factory=dict)  # status → first details
    timing: bool = False  # heartbeats are kept only while the timed rounds run

    def out(self, message: Any) -> Any:
        self.sent += message.ByteSize() + FRAME
        return message

    def back(self, message: Any) -> Any:
        self.received += message.ByteSize() + FRAME
        return message

    def fail(self, key: str, err: grpc.aio.AioRpcError) -> None:
        self.failed[key] += 1
        self.why.setdefault(key, err.details() or "")


@dataclasses.dataclass(slots=True)
class Member:
    stub: pb_grpc.CoordinatorStub
    client_id: str
    tier: int
    auth: tuple[tuple[str, str], ...]
    messages: list[pb.SubmitMessage]  # its tier's results, shared by the tier's members
    free_rider: bool = False  # takes work, never delivers
    train_s: float = 0.0  # how long its training of a round takes (simulated: a sleep)
    beat_channel: grpc.aio.Channel | None = None  # to the heartbeat process, when there is one

    @property
    def beat_stub(self) -> pb_grpc.CoordinatorStub:
        """Where its heartbeats go: JoinReply.heartbeat_port, else with every other call."""
        return (self.stub if self.beat_channel is None
                else pb_grpc.CoordinatorStub(self.beat_channel))

    def submission(self, work: pb.RoundAssignment, tokens: int, traffic: Traffic
                   ) -> Iterator[pb.SubmitMessage]:
        header = pb.SubmitHeader(round=work.round, client_id=self.client_id, tokens=tokens,
                                 loss=3.0, train_seconds=1.0, assignment_id=work.assignment_id)
        yield traffic.out(pb.SubmitMessage(header=header))
        for message in self.messages:
            for result in message.results.results:
                result.tokens = tokens  # in place: the tensors are not copied
            yield traffic.out(message)


def spread(messages: list[pb.SubmitMessage], shift: int) -> list[pb.SubmitMessage]:
    """A member's own results: the tier's, each chunk's positions moved by ``shift`` (mod the
    chunk's size; still ascending, as a member sends them), so that members behind one relay
    send positions of their own, as real members mostly do, and its partial sum grows with
    them as it would."""
    own = []
    for message in messages:
        for shared in message.results.results:
            result = pb.SparseResult()
            result.CopyFrom(shared)
            if result.chunk:
                size = ChunkGrid(shape=tuple(result.shape), chunk=tuple(result.chunk)).chunk_numel
                positions = decode_tensor(result.indices)
                moved, order = ((positions.long() + shift) % size).sort(dim=1)
                values = decode_tensor(result.values)
                result.indices.CopyFrom(encode_tensor(moved.to(positions.dtype)))
                result.values.CopyFrom(encode_tensor(values.gather(1, order)))
            own.append(result)
    return list(result_batches(own))


async def join(channel: grpc.aio.Channel, run_id: str, index: int, tier: int,
               messages: dict[int, list[pb.SubmitMessage]], traffic: Traffic,
               admitted: asyncio.Semaphore, *, own: bool = False) -> Member:
    """Member ``index`` joins, as many at once as the server takes calls without a session
    (a refused Join is tried again, as the client does), and reports its speed."""
    stub = pb_grpc.CoordinatorStub(channel)
    request = pb.JoinRequest(
        run_id=run_id, join_token=JOIN_TOKEN, client_name=f"member-{index}",
        capabilities=pb.Capabilities(device_kind="cpu", memory_bytes=2**40, requested_tier=tier,
                                     tokens_per_second=1000.0, load_strategy="auto"))
    async with admitted:
        while True:
            try:
                reply = traffic.back(await stub.Join(traffic.out(request)))
                break
            except grpc.aio.AioRpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                await asyncio.sleep(0.1)
    results = spread(messages[reply.tier], index * 977) if own else messages[reply.tier]
    member = Member(stub, reply.client_id, reply.tier, session_metadata(reply.session_token),
                    results)
    if reply.heartbeat_port:
        member.beat_channel = grpc.aio.insecure_channel(f"127.0.0.1:{reply.heartbeat_port}",
                                                        options=GRPC_OPTIONS)
    traffic.back(await member.beat_stub.Heartbeat(traffic.out(pb.HeartbeatRequest(
        round=reply.round, tokens_per_second=1000.0)), metadata=member.auth))
    return member


async def heartbeats(member: Member, every_s: float, traffic: Traffic) -> None:
    """Beats every ``every_s`` from a random phase, on schedule: a slow answer delays no
    later beat's start."""
    start = time.monotonic() + random.uniform(0, every_s)
    stub = member.beat_stub
    for k in range(10**9):
        await asyncio.sleep(max(0.0, start + k * every_s - time.monotonic()))
        sent = time.perf_counter()
        try:
            traffic.back(await stub.Heartbeat(traffic.out(pb.HeartbeatRequest()),
                                              metadata=member.auth))
        except grpc.aio.AioRpcError as err:  # the next beat is on schedule anyway
            if member.free_rider and err.code() == grpc.StatusCode.PERMISSION_DENIED:
                return  # excluded
            if err.code() not in TRANSIENT:
                raise
            traffic.fail(f"Heartbeat {err.code().name}", err)
            continue
        if traffic.timing:
            traffic.heartbeats.append(time.perf_counter() - sent)


TRANSIENT = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
             grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)
RETRIES = 20


async def retried(call: Callable[[], Awaitable[T]], traffic: Traffic) -> T:
    """``call()``, made again after a transient failure, as the client's calls are (each
    failure counted by its status)."""
    for attempt in range(RETRIES):
        try:
            return await call()
        except grpc.aio.AioRpcError as err:
            if err.code() not in TRANSIENT or attempt == RETRIES - 1:
                raise
            traffic.fail(err.code().name, err)
            await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


async def play(member: Member, last_round: int, traffic: Traffic) -> None:
    """The member's rounds up to ``last_round`` (not played): work, sequences, results, and
    the round's update; a free rider's until it is excluded."""
    try:
        await _play(member, last_round, traffic)
    except grpc.aio.AioRpcError as err:
        if not (member.free_rider and err.code() == grpc.StatusCode.PERMISSION_DENIED):
            raise


async def _play(member: Member, last_round: int, traffic: Traffic) -> None:
    auth = member.auth
    while True:
        work = traffic.back(await retried(lambda: member.stub.GetRound(
            traffic.out(pb.GetRoundRequest()), metadata=auth), traffic))
        if work.state == pb.ROUND_STATE_FINISHED or work.round >= last_round:
            return
        if work.state != pb.ROUND_STATE_TRAIN:
            await asyncio.sleep(max(work.retry_after_seconds, MIN_WAIT_S))
            continue
        await train(member, work, traffic)


async def train(member: Member, work: pb.RoundAssignment, traffic: Traffic) -> None:
    """One round's calls: its sequences, its results, then its update once it closed."""
    auth = member.auth
    fetch = pb.FetchSequencesRequest(ids=list(dict.fromkeys(work.sequence_ids)))
    lengths = {s.id: s.tokens.shape[0] for s in await retried(lambda: collect(
        member.stub.FetchSequences(traffic.out(fetch), metadata=auth), traffic), traffic)}
    tokens = sum(lengths[i] for i in work.sequence_ids)
    await asyncio.sleep(member.train_s)
    if not member.free_rider:
        traffic.back(await retried(lambda: member.stub.SubmitResult(
            member.submission(work, tokens, traffic), metadata=auth), traffic))
    request = pb.GetUpdatesRequest(since_round=work.round, wait_seconds=UPDATE_WAIT_S,
                                   tier=member.tier)
    while not await retried(lambda: collect(member.stub.GetUpdates(
            traffic.out(request), metadata=auth), traffic), traffic):
        pass


async def collect(stream: AsyncIterator[T], traffic: Traffic) -> list[T]:
    return [traffic.back(message) async for message in stream]


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process ``pid``, every thread of it, and of its children alive
    now (the coordinator's heartbeat process, its close shards). A thread or child that ends
    while it is read counts nothing (its /proc entries are gone)."""
    stat = proc_text(Path(f"/proc/{pid}/stat"))
    if not stat:
        return 0.0
    fields = stat.rsplit(")", 1)[1].split()
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except FileNotFoundError:
        tasks = []
    children = {int(c) for task in tasks for c in proc_text(task / "children").split()}
    return ((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            + sum(cpu_seconds(c) for c in children))


def proc_text(path: Path) -> str:
    """A /proc file's text, or "" once the thread or process it describes has ended."""
    try:
        return path.read_text()
    except (FileNotFoundError, ProcessLookupError):
        return ""


def status_field(pid: int, name: str) -> int:
    """The first number of field ``name`` in /proc/PID/status (-1 if it has none)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{name}:"):
            return int(line.split()[1])
    return -1


def peak_rss_mib(pid: int) -> float:
    return status_field(pid, "VmHWM") / 1024  # kB


def start_pinned(config: RunConfig, threads: int | None) -> tuple[ServerProcess, bool]:
    """The coordinator's process on the first core and this one on the rest, where there are
    two or more (a process starts with its parent's cores, every thread of it); whether it
    was pinned."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return ServerProcess(config, threads), False
    os.sched_setaffinity(0, cores[:1])
    try:
        server = ServerProcess(config, threads)
    finally:
        os.sched_setaffinity(0, cores[1:])
    return server, True


def start_relays(args: argparse.Namespace, upstream: int, folder: Path, deadline_s: float
                 ) -> dict[int, Child]:
    """``args.relays`` relays (``matformer relay``) in front of the coordinator at
    ``upstream``, each a process on this process's cores, by the port members reach it on."""
    relays = {}
    for index in range(args.relays):
        port = free_port()
        argv = python_module(
            "matformer.relay.main", "--upstream", f"127.0.0.1:{upstream}", "--port", str(port),
            "--name", f"relay-{index}", "--relay-token", RELAY_TOKEN,
            "--member-token", JOIN_TOKEN, "--dir",
            str(folder / f"relay-{index}"), "--deadline-s", f"{deadline_s:g}",
            "--topk", str(args.relay_topk))
        relays[port] = Child.start(f"relay-{index}", argv, env=child_env())
        wait_serving(f"127.0.0.1:{port}", relays[port], 300.0)
    return relays


def root_bytes(server: ServerProcess) -> tuple[int, int]:
    """What the coordinator received from and sent to its members (relays, or the members
    themselves), as it counts them."""
    members = server.snapshot(since_round=None)["members"]
    return sum(m["bytes_up"] for m in members), sum(m["bytes_down"] for m in members)


async def measure(args: argparse.Namespace, members: int, folder: Path, mdat: Path,
                  messages: dict[int, list[pb.SubmitMessage]], riders: int = 0,
                  budget: int = 0) -> dict[str, Any]:
    """One case: ``members`` honest members, and ``riders`` free riders beside them; the
    round's budget that of ``budget`` members (0: all of them), so a case with free riders
    and its reference without them ask the honest for the same work."""
    honest, members = members, members + riders
    # a round's budget for everyone, so the free riders take work in the warm-up round; and
    # min_clients counts the honest, so the run goes on once the free riders are excluded
    config = many_config(args, budget or members, folder / f"{honest}+{riders}-members", mdat)
    config = dataclasses.replace(config, round=dataclasses.replace(
        config.round, min_clients=args.relays or honest))
    (folder / f"{honest}+{riders}-members").mkdir()
    cores = os.sched_getaffinity(0)
    server, pinned = start_pinned(config, args.threads)
    pid = server.process.pid
    traffic, tasks = Traffic(), []
    joined: list[Member] = []
    relays: dict[int, Child] = {}
    channels: list[grpc.aio.Channel] = []
    tiers = tiers_of(args)
    try:
        relays = start_relays(args, server.grpc_port, folder / f"{honest}+{riders}-members",
                              0.9 * config.round.deadline_s)
        ports = list(relays) or [server.grpc_port]
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{ports[i % len(ports)]}",
                                              options=GRPC_OPTIONS) for i in range(members)]
        joining = time.perf_counter()
        admitted = asyncio.Semaphore(CallLimits().anonymous)
        def joining_(indices: range) -> Awaitable[list[Member]]:
            return asyncio.gather(*(join(channels[i], config.run.id, i, tiers[i % len(tiers)],
                                         messages, traffic, admitted, own=bool(relays))
                                    for i in indices))

        # free riders first: the first round, which opens once the honest are in, holds them
        riding = await joining_(range(honest, members))
        joined = [*await joining_(range(honest)), *riding]
        join_s = time.perf_counter() - joining
        for member in joined:
            member.train_s = args.train_s
        for member in joined[honest:]:
            member.free_rider = True
        tasks = [asyncio.create_task(heartbeats(m, args.heartbeat_s, traffic)) for m in joined]
        last = WARMUP_ROUNDS + args.rounds
        playing = [asyncio.create_task(play(m, last, traffic)) for m in joined]
        while server.snapshot(since_round=None)["round"] < WARMUP_ROUNDS:
            if any(p.done() for p in playing):
                await asyncio.gather(*playing)  # a member failed: say why
            await asyncio.sleep(0.05)
        start, cpu, mine = time.perf_counter(), cpu_seconds(pid), time.process_time()
        relay_cpu = sum(cpu_seconds(r.process.pid) for r in relays.values())
        sent, received = traffic.sent, traffic.received
        root_in, root_out = root_bytes(server)
        traffic.timing = True
        await asyncio.gather(*playing)
        while server.snapshot(since_round=None)["round"] < last:
            await asyncio.sleep(0.05)
        wall = time.perf_counter() - start
        traffic.timing = False
        cpu, mine = cpu_seconds(pid) - cpu, time.process_time() - mine
        relay_cpu = sum(cpu_seconds(r.process.pid) for r in relays.values()) - relay_cpu
        root_in, root_out = (now - then for now, then in zip(root_bytes(server),
                                                             (root_in, root_out), strict=True))
        threads = status_field(pid, "Threads")  # gRPC's pool never shrinks: its peak
        records = [r for r in server.snapshot(since_round=WARMUP_ROUNDS)["rounds"]
                   if r["round"] < last]
        beats = sorted(traffic.heartbeats)
        excluded = len(server.snapshot(since_round=None)["excluded"])
        return {
            "members": honest, "free_riders": riders, "excluded": excluded,
            "beats": args.beats,
            "rounds": args.rounds,
            "rounds_per_min": 60 * args.rounds / wall,
            "close_ms": statistics.median(r["close_s"] for r in records) * 1e3,
            "coordinator_cpu_s_per_round": cpu / args.rounds,
            "coordinator_rss_mib": peak_rss_mib(pid),
            "bytes_in_per_round": (traffic.sent - sent) / args.rounds,
            "bytes_out_per_round": (traffic.received - received) / args.rounds,
            # at the coordinator: equal to the above without relays, the relays' with them
            "root_bytes_in_per_round": root_in / args.rounds,
            "root_bytes_out_per_round": root_out / args.rounds,
            "relays": args.relays, "relay_topk": args.relay_topk,
            "relays_cpu_s_per_round": relay_cpu / args.rounds,
            "heartbeat_p99_ms": (beats[min(len(beats) - 1, int(0.99 * len(beats)))] * 1e3
                                 if beats else float("nan")),
            "heartbeat_max_ms": beats[-1] * 1e3 if beats else float("nan"),
            "heartbeats": len(beats), "failed_calls": dict(traffic.failed),
            "failed_details": dict(traffic.why), "join_s": join_s, "timed_s": wall,
            "coordinator_threads": threads,
            "members_cpu_share": mine / wall / max(
                1, len(os.sched_getaffinity(0))), "coordinator_pinned": pinned}
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(channel.close() for channel in channels),
                             *(m.beat_channel.close() for m in joined if m.beat_channel))
        for relay in relays.values():
            relay.stop()
        server.stop()
        os.sched_setaffinity(0, cores)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    submissions = Submissions(args)
    params = sum(torch.Size(s).numel() for s in submissions.shapes.values())
    messages = {tier: list(result_batches(encode_sparse_result(r)
                                          for r in submissions.results(tier, tier)))
                for tier in tiers_of(args)}
    print(f"torch {torch.__version__} | {os.cpu_count()} cores | {args.shape}: {params:,} params "
          f"| {args.encoding} chunk {args.chunk} top {args.topk} {args.value_dtype} | heartbeat "
          f"every {args.heartbeat_s:g} s | {args.rounds} timed rounds | load average "
          f"{os.getloadavg()[0]:.2f}", flush=True)
    cases = []
    with tempfile.TemporaryDirectory(prefix="matformer-bench-") as tmp:
        folder = Path(tmp)
        mdat = folder / "docs.mdat"
        build_default_mdat(mdat, limit=200).close()
        for n in args.counts:
            began = time.perf_counter()
            cases.append(asyncio.run(measure(args, n, folder, mdat, messages,
                                             budget=n + args.free_riders)))
            case = cases[-1]
            case["case_s"] = time.perf_counter() - began
            if args.free_riders:
                with_riders = asyncio.run(measure(args, n, folder, mdat, messages,
                                                  args.free_riders))
                case["with_free_riders"] = with_riders
                case["free_rider_rate_ratio"] = (with_riders["rounds_per_min"]
                                                 / case["rounds_per_min"])
                print(f"{n} members and {args.free_riders} free riders: "
                      f"{with_riders['rounds_per_min']:.1f} rounds/min, "
                      f"{with_riders['excluded']} excluded; rounds/min with free riders / "
                      f"without: {case['free_rider_rate_ratio']:.2f}", flush=True)
            print(f"{n} members: {case['rounds_per_min']:.1f} rounds/min; case "
                  f"{case['case_s']:.0f} s (joins {case['join_s']:.1f} s, timed rounds "
                  f"{case['timed_s']:.1f} s); coordinator threads {case['coordinator_threads']}"
                  + (f"; failed calls {case['failed_calls']} {case['failed_details']}"
                     if case["failed_calls"] else ""), flush=True)
    print()
    print_table(["members", "rounds/min", "close ms", "coord cpu s/round", "coord rss MiB",
                 "MB in/round", "MB out/round", "root MB in", "root MB out", "hb p99 ms",
                 "members cpu", "relays cpu s/round"],
                [[f"{c['members']:,}", f"{c['rounds_per_min']:.1f}", f"{c['close_ms']:,.0f}",
                  f"{c['coordinator_cpu_s_per_round']:.2f}", f"{c['coordinator_rss_mib']:,.0f}",
                  f"{c['bytes_in_per_round'] / 1e6:,.2f}",
                  f"{c['bytes_out_per_round'] / 1e6:,.2f}",
                  f"{c['root_bytes_in_per_round'] / 1e6:,.2f}",
                  f"{c['root_bytes_out_per_round'] / 1e6:,.2f}", f"{c['heartbeat_p99_ms']:,.1f}",
                  f"{c['members_cpu_share']:.0%}", f"{c['relays_cpu_s_per_round']:.2f}"]
                 for c in cases])
    first = cases[0]
    print()
    for c in cases[1:]:
        print(f"{c['members']:,} vs {first['members']:,} members: coordinator cpu per round x"
              f"{c['coordinator_cpu_s_per_round'] / first['coordinator_cpu_s_per_round']:.1f}, "
              f"bytes in x{c['bytes_in_per_round'] / first['bytes_in_per_round']:.1f}, "
              f"rounds/min x{c['rounds_per_min'] / first['rounds_per_min']:.2f}")
    members_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak rss of the members' process: {members_mib:,.0f} MiB")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(cases, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
