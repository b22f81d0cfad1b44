"""The coordinator's work at the close of a round for 1, 4, 16 and 64 clients: does it grow at
most linearly in the number of clients?

One process starts a real ``matformer-server`` (``RunningServer.start`` on loopback, ports 0)
for each client count N, with ``min_clients = N``, and drives N simulated clients through the
real gRPC stubs: Join (each asks for tier ``i % 3``), then per round GetRound and
SubmitResult. The clients train nothing: before any timing, each encodes a random gradient
of its tier's region of every parameter through error feedback, as a client does
(``CompressionConfig`` defaults unless flags override them: DCT, chunk 64, top 32, bfloat16
values), and the encoded messages are sent again every round with a new header.

What is timed, on the server, by wrapping the coordinator instance's methods (server code is
untouched): ``close``, the whole of ``Coordinator._close`` (aggregate every parameter over the
clients' results, apply the update rule to the master, hash the master per tier, log the
update, save state.json), and inside it ``aggregate`` (``modeling.compression.aggregate``
over all parameters), ``hash`` (``tier_hashes``), ``log + save`` (update log and state.json),
and ``apply + rest`` (what remains: mostly the update rule). Checkpoints are kept out: the
run's checkpoint interval is larger than the run, which is also longer than the rounds played.
``round wall`` is the client side: the first GetRound to the return of the last
SubmitResult, which closes the round (and opens the next) before it answers. ``received``
is the bytes of accepted submissions per round (the round's record, ``bytes_sent``);
``update`` the bytes of one round's GetUpdates stream, which every client downloads, and the
time one client takes to read it.

Each client count plays one untimed warm-up round, then ``--rounds`` timed ones; medians are
shown. The coordinator would measure each client's speed from its submission time and share
the next round's sequences by it; these clients submit one after another without training, so
the benchmark keeps their reported speeds (``membership.measured`` is a no-op here) and every
client gets an equal share of every round. ``ms per client`` at N over at 1 client should stay
at or below 1 (the per-round costs, hashing and logging, are shared by more clients; the check
allows 1.25 for noise), and the marginal cost of one more client should not rise with N.

    python bench/server_aggregate.py                      # 1, 4, 16, 64 clients (about 40 s)
    python bench/server_aggregate.py --clients 1,8,32 --rounds 5 --hidden-size 512
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import torch
from harness import print_table

import server.coordinator
from modeling import ModelConfig
from modeling.compression import CompressionConfig, region_shape, tier_regions, universal_shapes
from modeling.mdat import build_default_mdat
from protocol.auth import session_metadata
from protocol.channel import GRPC_OPTIONS
from protocol.matformer.v1 import coordinator_pb2 as pb
from protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from protocol.sparse import encode_sparse_result
from server.config import RunConfig
from server.coordinator import Coordinator
from server.main import RunningServer

JOIN_TOKEN = "bench"
RESULT_TOKENS = 512  # the count encoded at first; each round sends its assignment's count
STEPS = ("aggregate", "hash", "log + save")  # timed inside close; "apply + rest" is the remainder


def parse_args() -> argparse.Namespace:
    defaults = CompressionConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model = parser.add_argument_group("model")
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
    run.add_argument("--tiers", default="0,1,2", help="client i asks for tier tiers[i % len]")
    run.add_argument("--rounds", type=int, default=3, help="timed rounds per client count")
    run.add_argument("--rule", choices=["sign", "sgd"], default="sign")
    run.add_argument("--encoding", choices=["dense", "topk", "dct"], default=defaults.encoding)
    run.add_argument("--chunk", type=int, default=defaults.chunk)
    run.add_argument("--topk", type=int, default=defaults.topk)
    run.add_argument("--value-dtype", default=defaults.value_dtype)
    run.add_argument("--sequences-per-client", type=int, default=4,
                     help="round token budget = clients x this x --seq-len")
    run.add_argument("--threads", type=int, default=None)
    return parser.parse_args()


def tiers_of(args: argparse.Namespace) -> list[int]:
    return sorted({int(t) for t in args.tiers.split(",")})


def model_config(args: argparse.Namespace) -> ModelConfig:
    return ModelConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate_size, max_position_embeddings=args.seq_len,
        pad_token_id=None, bos_token_id=None, eos_token_id=None, mask_token_id=None,
    )


def run_config(args: argparse.Namespace, clients: int, folder: Path, mdat: Path) -> RunConfig:
    """The run.toml tables of one client count, read as ``RunConfig.load`` reads the file."""
    tables: dict[str, Any] = {
        "run": {"id": f"bench-{clients}", "dir": str(folder / f"run-{clients}")},
        "model": {"inline": {k: v for k, v in model_config(args).to_dict().items()
                             if v is not None}},
        "data": {"path": str(mdat), "max_seq_len": args.seq_len},
        "tiers": {"allowed": tiers_of(args)},
        # One warm-up round, the timed ones, and one more so that no timed round ends the run
        # (the last round always checkpoints).
        "round": {"min_clients": clients, "deadline_s": 3600.0, "rounds": args.rounds + 2,
                  "tokens_per_round": clients * args.sequences_per_client * args.seq_len},
        "update": {"rule": args.rule, "lr": 1e-3, "schedule": "constant"},
        "compression": {"encoding": args.encoding, "chunk": args.chunk, "topk": args.topk,
                        "value_dtype": args.value_dtype},
        "checkpoint": {"every_rounds": 10**9},
        # a close of a large model outlasts the default heartbeat timeout (these clients do
        # not heartbeat while they wait), and all N join at once
        "faults": {"heartbeat_timeout_s": 3600.0, "max_joins_per_minute": 100_000},
        "auth": {"join_token": JOIN_TOKEN},
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
        """One SubmitMessage per parameter: the first round's result of a random gradient."""
        if (index, tier) not in self._made:
            torch.manual_seed(index)
            regions = tier_regions(self.shapes, self.config, tier)
            self._made[index, tier] = [
                pb.SubmitMessage(result=encode_sparse_result(
                    self.compressor.feedback(name, self.shapes[name], region).step(
                        torch.randn(region_shape(region)), RESULT_TOKENS)))
                for name, region in sorted(regions.items())
            ]
        return self._made[index, tier]


@dataclass(slots=True)
class Client:
    client_id: str
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
            message.result.tokens = tokens  # in place: the tensors are not copied
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
        coordinator._close = self._close(coordinator._close)
        coordinator.tier_hashes = self._step("hash", coordinator.tier_hashes)
        coordinator.log.append = self._step("log + save", coordinator.log.append)
        coordinator._save = self._step("log + save", coordinator._save)

    def _close(self, close: Callable[[Any], None]) -> Callable[[Any], None]:
        def timed(closing: Any) -> None:  # the detached round (server.coordinator._Closing)
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
        """``modeling.compression.aggregate``, timed; installed by ``measure`` for a run."""
        return self._step("aggregate", work)


@dataclass(slots=True)
class Row:
    clients: int
    closes: list[CloseTimes]
    walls: list[float]  # seconds, client side
    received: list[int]  # bytes of all submissions per round
    update_bytes: int  # GetUpdates of one round, as each client downloads it
    update_s: float  # and the seconds that download took

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
        schema=pb.Schema(canonical_hash=running.service.schema_hash)))
    return Client(reply.client_id, session_metadata(reply.session_token),
                  submissions.messages(index, reply.tier))


def play_round(stub: pb_grpc.CoordinatorStub, clients: list[Client],
               coordinator: Coordinator) -> tuple[int, float]:
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
    for client in clients:
        tokens = coordinator.assignment_for(client.client_id).tokens
        stub.SubmitResult(client.stream(round_index, assignments[client.client_id], tokens),
                          metadata=client.auth)
    return round_index, time.perf_counter() - start


def measure(args: argparse.Namespace, clients: int, folder: Path, mdat: Path,
            submissions: Submissions) -> Row:
    config = run_config(args, clients, folder, mdat)
    tiers = tiers_of(args)
    running = RunningServer.start(config, grpc_port=0, http_port=0)
    coordinator = running.service.coordinator
    timer = CloseTimer(coordinator)
    # These clients do no work, so the speeds their submission times suggest mean nothing.
    coordinator.membership.measured = lambda *_args, **_kwargs: None
    aggregate = server.coordinator.aggregate
    server.coordinator.aggregate = timer.aggregate(aggregate)
    channel = grpc.insecure_channel(f"127.0.0.1:{running.grpc_port}", options=GRPC_OPTIONS)
    try:
        stub = pb_grpc.CoordinatorStub(channel)
        members = [join(stub, running, i, tiers[i % len(tiers)], submissions)
                   for i in range(clients)]
        play_round(stub, members, running.service.coordinator)  # warm-up
        walls, received = [], []
        for _ in range(args.rounds):
            round_index, seconds = play_round(stub, members, running.service.coordinator)
            walls.append(seconds)
            record = running.service.coordinator.state.rounds[-1]
            assert record["round"] == round_index
            received.append(record["bytes_sent"])
        start = time.perf_counter()
        update = stub.GetUpdates(pb.GetUpdatesRequest(since_round=round_index),
                                 metadata=members[0].auth)
        update_bytes = sum(message.ByteSize() for message in update)
        update_s = time.perf_counter() - start
        timed = timer.closes[1:]
        if any(c.clients != clients for c in timed):
            raise SystemExit(f"a round closed with {[c.clients for c in timed]} submissions, "
                             f"not {clients}; every client should submit every round.")
        return Row(clients, timed, walls, received, update_bytes, update_s)
    finally:
        server.coordinator.aggregate = aggregate
        channel.close()
        running.stop()


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
        f"{args.topk}, values {args.value_dtype} | rule {args.rule} | tiers {args.tiers} | "
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
        rows = [measure(args, n, folder, mdat, submissions) for n in counts]
    print_table(
        ["clients", "close ms", "ms/client", "aggregate ms", "hash ms", "log + save ms",
         "apply + rest ms", "round wall ms", "received KiB", "update KiB",
         "update ms"],
        [[str(r.clients), f"{r.close_s() * 1e3:,.1f}", f"{r.close_s() * 1e3 / r.clients:,.2f}",
          *(f"{r.close_s(s) * 1e3:,.1f}" for s in STEPS), f"{r.rest_s() * 1e3:,.1f}",
          f"{statistics.median(r.walls) * 1e3:,.0f}",
          f"{statistics.median(r.received) / 2**10:,.0f}",
          f"{r.update_bytes / 2**10:,.0f}", f"{r.update_s * 1e3:,.0f}"] for r in rows],
    )
    first, last = rows[0], rows[-1]
    ratio = (last.close_s() / last.clients) / (first.close_s() / first.clients)
    print(f"ms per client at {last.clients} / at {first.clients}: {ratio:.2f} "
          f"(at most linear: {'yes' if ratio <= 1.25 else 'no'})")
    marginal = [f"{a.clients}->{b.clients}: "
                f"{(b.close_s() - a.close_s()) * 1e3 / (b.clients - a.clients):,.2f}"
                for a, b in itertools.pairwise(rows)]
    print(f"close ms per added client: {', '.join(marginal)} (flat or falling: linear)")


if __name__ == "__main__":
    main()
