"""Quality at equal tokens on the embedded corpus: final held-out loss per tier.

The runs train the same model (``client.standalone.TINY``) from the same initial weights on
the same sequences of the stdlib-docstrings MDAT:

  A  federated: a real coordinator and 3 ``FederatedClient``s at tiers 0, 1, 2; DeMo
     compression (``CompressionConfig`` defaults: DCT, chunk 64, top 32, bfloat16), rule sign
  B  the same, all 3 clients at tier 0
  C  as A with encoding dense: the dense float32 gradient, rule sign at the same lr
  E  as A with the exact broadcast ([update] broadcast_topk = 0): the aggregate's signs, one
     byte per element down, where A downloads the top 48 coefficients per chunk
  L  local steps: 3 clients at tiers 0, 1, 2 each train their share of a round as AdamW
     steps of ``--batch-tokens`` (D's batch) and send the DCT-compressed pseudo-gradient; the
     coordinator's outer step is SGD of ``--outer-lr`` with ``--outer-momentum`` (Nesterov).
     The same tokens in ``--local-rounds`` rounds
  LB as L, all 3 clients at tier 0 (as B is to A); each trains tier 0 alone, as in every
     federated run here (``FederatedOptions.also_train`` empty), where P sums tiers 0, 1, 2
  LT as LB, each client also training tiers 1 and 2 in every step (``--also-train 1 2``):
     the losses P sums, so LT / P at tiers 1 and 2 compares like with like
  O  as L with overlapped rounds ([round] overlap): each round trains on the weights after
     the round before last, while that round closes; same sequences, same tokens
  AF as A with a fourth client at tier 0 that trains honestly and submits its results with
     the sign flipped (an honest norm, so no norm bound sees it); contribution scores on, as
     by default (server/scores.py): it is excluded once [faults] score_rounds of its rounds
     are scored, and the three honest clients train on
  AU as AF with [faults] score_rounds = 0: the flipped client stays to the end
  LF, LU as AF and AU for L
  D  standalone: AdamW (as ``matformer-train``), tiers 0, 1, 2 summed every step
  P  as D in steps of 3 × ``--batch-tokens``: what data-parallel training by 3 workers at
     L's inner batch computes, a third of D's steps. LB replaces it, so LB / P is the price
     of local steps and compression over data parallelism (L's inner steps clip at 1.0
     as P's do, at a constant lr after warmup where P's follows a cosine: the constant
     lr measured 3% better for LB, ``--inner-schedule cosine`` is P's; ``--inner-clip 0``
     is the regime before issue 49); L / LB the price
     of heterogeneous tiers (L's FFN tail, trained by its tier-0 client alone, sees a third
     of the tokens, P's all of them); L / D adds the price of parallelism

The coordinator hands out the run's order (``server.work.work_order``: the shuffle of seed
``data.seed`` without the sequences that carry no target) from its start,
``--tokens-per-round`` per round; D trains on exactly the sequences those rounds take, in the
same order, in steps of ``--batch-tokens``. Held out: the order's tail that no run trains on
(``modeling.run_order``: the last 5%); every sequence a client trained on is checked against
it. Each run's initial and final universal checkpoints are evaluated at tiers 0, 1, 2; B's
and LB's tiers 1 and 2 are MatFormer slices of a model only ever trained at tier 0.

Bytes are every message a client sent and received (``ClientSummary.bytes_up/bytes_down``,
the join's checkpoint download included), per client and round. Against L stands what
data-parallel training would move for D's steps: a ring all-reduce of the float32 gradient
among 3 workers sends and receives 2·(3−1)/3 of the model's bytes per step and worker.

AF / A and AU / A (LF / L and LU / L) are the price of a sign-flipped member caught and
not caught; the lines
after the table give its scores and the round it was excluded in.

``--attack-scale F``: the first client (tier 0) trains honestly and submits every value
times F, a member lying about magnitude; ``--peer-clip`` sets the defence ([faults]
peer_clip; 0: off, unset: the run's default), ``--policy NAME`` the round policy of the
federated runs ([policy] name, e.g. trimmed_mean; ``--trim`` its fraction).

    python bench/federated_quality.py
    python bench/federated_quality.py --runs A,B --rounds 15 --lr 0.01
    python bench/federated_quality.py --runs L,D,P --json quality.json
    python bench/federated_quality.py --runs LB,L,P --seed 1
    python bench/federated_quality.py --runs L --attack-scale 1000
    python bench/federated_quality.py --runs A,AF,AU,L,LF,LU --json flip.json
    python bench/federated_quality.py --smoke     # A, AF, LB, D, P: one round, 60 docstrings
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from harness import parse, print_table
from torch import Tensor

from matformer.client.connection import Train
from matformer.client.errors import Excluded
from matformer.client.federated import FederatedClient, FederatedOptions
from matformer.client.standalone import TINY
from matformer.client.summary import ClientSummary
from matformer.modeling import ModelConfig, build_model
from matformer.modeling.batching import AdaptiveLimitsConfig, MicrobatchRunner, plan_batches
from matformer.modeling.checkpoint import load_pretrained
from matformer.modeling.compression import SparseResult
from matformer.modeling.matformer import tier_label
from matformer.modeling.mdat import (
    DEFAULT_DATA,
    DEFAULT_STRATEGY,
    Mdat,
    SequenceReader,
    build_default_mdat,
)
from matformer.modeling.naming import canonical_state_dict
from matformer.modeling.optim import OptimizerConfig
from matformer.modeling.run_order import RunOrder
from matformer.modeling.training import TierSchedule, held_out_loss, train_step_on_examples
from matformer.server.config import RunConfig
from matformer.server.main import RunningServer
from matformer.server.work import WorkQueue, work_order

TIERS = [0, 1, 2]  # evaluated for every run
EVAL_BATCH_TOKENS = 8192
TOKEN = "federated-quality"
STRATEGY = DEFAULT_STRATEGY["strategy_name"]


@dataclass(frozen=True)
class FederatedRun:
    tiers: tuple[int, ...]  # one client per entry
    encoding: str  # [compression] encoding
    value_dtype: str  # [compression] value_dtype
    broadcast_topk: int | None = None  # [update] broadcast_topk (None: the default)
    local_steps: bool = False  # [inner] steps of --batch-tokens, DiLoCo's outer step
    overlap: bool = False  # [round] overlap: round r trains on the weights after r - 1 rounds
    flipped: bool = False  # one more client, at tier 0, submits its results sign-flipped
    scored: bool = True  # False: [faults] score_rounds = 0, scores exclude no one
    also_train: tuple[int, ...] = ()  # each client's smaller tiers, trained in the same step

    @property
    def clients(self) -> tuple[int, ...]:
        """Every client's tier: the honest ones, then the flipped one, if any."""
        return (*self.tiers, 0) if self.flipped else self.tiers


RUNS = {
    "A": FederatedRun(tiers=(0, 1, 2), encoding="dct", value_dtype="bfloat16"),
    "B": FederatedRun(tiers=(0, 0, 0), encoding="dct", value_dtype="bfloat16"),
    "C": FederatedRun(tiers=(0, 1, 2), encoding="dense", value_dtype="float32"),
    "E": FederatedRun(tiers=(0, 1, 2), encoding="dct", value_dtype="bfloat16", broadcast_topk=0),
    "L": FederatedRun(tiers=(0, 1, 2), encoding="dct", value_dtype="bfloat16", local_steps=True),
    "O": FederatedRun(tiers=(0, 1, 2), encoding="dct", value_dtype="bfloat16", local_steps=True,
                      overlap=True),
    "LB": FederatedRun(tiers=(0, 0, 0), encoding="dct", value_dtype="bfloat16", local_steps=True),
    "LT": FederatedRun(tiers=(0, 0, 0), encoding="dct", value_dtype="bfloat16", local_steps=True,
                       also_train=(1, 2)),
    "AF": FederatedRun(tiers=(0, 1, 2), encoding="dct", value_dtype="bfloat16", flipped=True),
    "AU": FederatedRun(tiers=(0, 1, 2), encoding="dct", value_dtype="bfloat16", flipped=True,
                       scored=False),
    "LF": FederatedRun(tiers=(0, 1, 2), encoding="dct", value_dtype="bfloat16", local_steps=True,
                       flipped=True),
    "LU": FederatedRun(tiers=(0, 1, 2), encoding="dct", value_dtype="bfloat16", local_steps=True,
                       flipped=True, scored=False),
}
DP_WORKERS = 3  # data-parallel reference: a ring all-reduce among this many workers
STANDALONE = "D"
DATA_PARALLEL = "P"  # standalone at the global batch of DP_WORKERS data-parallel workers
NAMES = ", ".join([*RUNS, STANDALONE, DATA_PARALLEL])  # what --runs takes
SMOKE = dict(runs="A,AF,LB,D,P", rounds=1, local_rounds=1, tokens_per_round=2048, warmup_rounds=0,
             documents=60)


class HeldOut:
    """Held-out losses per tier; a start bit-identical to one seen before is not re-evaluated."""

    def __init__(self, examples: list[Tensor]) -> None:
        self.examples = examples
        self.starts: list[tuple[dict[str, Tensor], dict[str, float]]] = []

    def start(self, model: torch.nn.Module) -> dict[str, float]:
        state = {n: t.detach().clone() for n, t in canonical_state_dict(model).items()}
        for seen, losses in self.starts:
            if seen.keys() == state.keys() and all(torch.equal(seen[n], state[n]) for n in seen):
                return losses
        self.starts.append((state, self.final(model)))
        return self.starts[-1][1]

    def final(self, model: torch.nn.Module) -> dict[str, float]:
        return held_out_loss(model, self.examples, TIERS, batch_tokens=EVAL_BATCH_TOKENS)


@dataclass
class Outcome:
    tokens: int
    initial: dict[str, float]
    final: dict[str, float]
    seconds: float
    summaries: list[ClientSummary]
    flipped: dict[str, Any] | None = None  # the flipped client's scores and exclusion


def flipped_record(coordinator: Any, name: str) -> dict[str, Any]:
    """The flipped client's score in each round that scored it, and the round whose close
    excluded it (None: it stayed)."""
    scores = [s["score"] for r in coordinator.state.rounds for s in r["scores"]
              if s["name"] == name]
    excluded = [e["round"] - 1 for e in coordinator.state.events
                if e["kind"] == "exclude" and e["name"] == name]
    return {"scores": scores, "excluded_after_round": excluded[0] if excluded else None}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="A,B,C,D,E,L,P",
                        help=f"comma-separated, any of {NAMES}")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--tokens-per-round", type=int, default=8192)
    parser.add_argument("--lr", type=float, default=0.02, help="sign rule's peak lr (A, B, C)")
    parser.add_argument("--warmup-rounds", type=int, default=3,
                        help="linear warmup, then cosine to lr/10")
    parser.add_argument("--adamw-lr", type=float, default=3e-3, help="D's peak lr")
    parser.add_argument("--batch-tokens", type=int, default=1024,
                        help="D's tokens per optimizer step (as matformer-train)")
    parser.add_argument("--local-rounds", type=int, default=30,
                        help="L's rounds, of rounds × tokens-per-round / local-rounds tokens")
    parser.add_argument("--inner-lr", type=float, default=None,
                        help="L's AdamW lr (default: --adamw-lr)")
    parser.add_argument("--inner-schedule", choices=("cosine", "linear", "constant"),
                        default="constant",
                        help="L's inner lr over the rounds (cosine, linear: to lr/10)")
    parser.add_argument("--inner-clip", type=float, default=1.0,
                        help="L's [inner] grad_clip: each inner step's gradient norm (0: "
                             "none; 1.0 as P and matformer train)")
    # With ~3 inner steps per client and round, DiLoCo's outer Nesterov SGD (lr 0.7,
    # momentum 0.9, the run's defaults under [inner]) diverges here; plain averaging is best
    parser.add_argument("--outer-lr", type=float, default=1.0,
                        help="L's outer lr (DiLoCo's: 0.7)")
    parser.add_argument("--outer-momentum", type=float, default=0.0,
                        help="L's outer Nesterov momentum (DiLoCo's: 0.9; 0: none)")
    parser.add_argument("--local-topk", type=int, default=None,
                        help="L's [compression] topk (default: DeMo's 32)")
    parser.add_argument("--local-broadcast-topk", type=int, default=None,
                        help="L's [update] broadcast_topk (default: 48)")
    parser.add_argument("--local-broadcast-bits", type=int, default=None,
                        help="L's [update] broadcast_bits (default: 8; 4, 2)")
    parser.add_argument("--local-value-dtype", default=None,
                        help="L's [compression] value_dtype (default: bfloat16; int2, int4, "
                             "int8: low-bit codes and a scale per chunk)")
    parser.add_argument("--json", type=Path, default=None,
                        help="write per run: final loss per tier, bytes up and down per "
                             "client per round")
    parser.add_argument("--documents", type=int, default=None,
                        help="docstrings in the corpus (default: all, in "
                             f"{DEFAULT_DATA}; else runs/python_docs-N.mdat)")
    parser.add_argument("--peer-clip", type=float, default=None,
                        help="[faults] peer_clip of the federated runs (0: off; default: "
                             "the run's default)")
    parser.add_argument("--attack-scale", type=float, default=None,
                        help="the first client submits its values times this (default: "
                             "every client honest)")
    parser.add_argument("--vote", choices=("mean", "majority"), default="mean",
                        help="[update] vote of the federated runs")
    parser.add_argument("--policy", default="mean",
                        help="[policy] name of the federated runs (server/policies/)")
    parser.add_argument("--trim", type=float, default=None,
                        help="--policy trimmed_mean's [policy.options] trim (default: its own)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0, help="data.seed: shuffle and init")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (process-wide)")
    parser.add_argument("--out", type=Path, default=Path("runs/federated_quality"),
                        help="run directories (replaced)")
    return parse(parser, SMOKE)


def data_path(documents: int | None) -> Path:
    """The default container, or a separate one for a limited corpus (the default is never
    rebuilt: ``build_default_mdat`` leaves a complete container as it is)."""
    path = DEFAULT_DATA if documents is None else DEFAULT_DATA.with_name(
        f"python_docs-{documents}.mdat")
    build_default_mdat(path, limit=documents).close()
    return path


def rounds_of(run: FederatedRun, args: argparse.Namespace) -> tuple[int, int]:
    """(rounds, tokens per round) of a run: L takes the same tokens in fewer rounds."""
    if run.local_steps:
        return args.local_rounds, args.rounds * args.tokens_per_round // args.local_rounds
    return args.rounds, args.tokens_per_round


def planned_rounds(order: RunOrder, reader: SequenceReader, rounds: int, tokens: int
                   ) -> list[list[int]]:
    """The sequence ids of each round, as the coordinator's queue takes them when no client
    drops out (each run checks it did)."""
    queue = WorkQueue(order)
    return [queue.take(tokens, lambda i: len(reader[i])) for _ in range(rounds)]


def run_config(name: str, run: FederatedRun, data: Path, args: argparse.Namespace) -> RunConfig:
    rounds, tokens = rounds_of(run, args)
    compression = {"encoding": run.encoding, "value_dtype": run.value_dtype}
    if run.local_steps:  # no [update] rule: DiLoCo's outer Nesterov SGD (server.sections)
        update = {"warmup_rounds": 0}
        if args.outer_lr is not None or args.outer_momentum is not None:
            momentum = 0.9 if args.outer_momentum is None else args.outer_momentum
            update |= {"rule": "sgd", "lr": args.outer_lr or 0.7, "schedule": "constant",
                       "momentum": momentum, "nesterov": momentum > 0}
        if args.local_topk is not None:
            compression["topk"] = args.local_topk
        if args.local_value_dtype is not None:
            compression["value_dtype"] = args.local_value_dtype
        if args.local_broadcast_bits is not None:
            update["broadcast_bits"] = args.local_broadcast_bits
        if args.local_broadcast_topk is not None:
            update["broadcast_topk"] = args.local_broadcast_topk
        # D's schedule over the run: warmup for a tenth of a client's steps (about a third
        # of D's), then cosine to lr / 10 over the rounds
        inner_lr = args.inner_lr or args.adamw_lr
        client_steps = rounds * tokens // args.batch_tokens // len(run.tiers)
        inner = {"batch_tokens": args.batch_tokens, "lr": inner_lr, "weight_decay": 0.01,
                 "warmup_steps": max(1, client_steps // 10), "schedule": args.inner_schedule,
                 "final_lr": inner_lr / 10, "grad_clip": args.inner_clip}
    else:
        update = {"rule": "sign", "lr": args.lr, "warmup_rounds": args.warmup_rounds,
                  "schedule": "cosine", "final_lr": args.lr / 10, "vote": args.vote}
        inner = {}
    if run.broadcast_topk is not None:
        update["broadcast_topk"] = run.broadcast_topk
    return RunConfig.from_dict({
        "run": {"id": f"quality-{name}", "dir": str(args.out / name)},
        "model": {"inline": {**TINY, "vocab_size": 260}},
        "data": {"path": str(data), "strategy": STRATEGY, "max_seq_len": args.seq_len,
                 "seed": args.seed},
        "tiers": {"allowed": TIERS},
        "round": {"min_clients": len(run.tiers), "deadline_s": 3600.0,  # the honest ones
                  "tokens_per_round": tokens, "rounds": rounds, "overlap": run.overlap},
        "compression": compression,
        "update": update,
        "inner": inner,
        "checkpoint": {"every_rounds": rounds},
        "faults": {**({} if args.peer_clip is None else {"peer_clip": args.peer_clip}),
                   **({} if run.scored else {"score_rounds": 0})},
        "policy": {"name": args.policy,
                   "options": {} if args.trim is None else {"trim": args.trim}},
        "auth": {"join_token": TOKEN},
    })


class _Recording(FederatedClient):
    """Remembers every sequence id it trained and the coordinator took."""

    trained: tuple[int, ...] = ()  # none until a round of its is taken

    def accepted(self, work: Train, *args: Any) -> None:
        self.trained = (*self.trained, *work.sequence_ids)
        return super().accepted(work, *args)


class _Attacking(_Recording):
    """Trains as an honest member and submits every value times ``scale`` (its own state,
    error feedback included, stays honest): a member that lies about magnitude."""

    def __init__(self, options: FederatedOptions, scale: float, **kwargs: Any) -> None:
        super().__init__(options, **kwargs)
        honest = self.connection.submit

        def scaled(work: Train, *, results: Sequence[SparseResult], **rest: Any
                   ) -> tuple[int, int]:
            loud = [dataclasses.replace(r, values=(r.values.double() * scale).to(r.values.dtype))
                    for r in results]
            return honest(work, results=loud, **rest)

        self.connection.submit = scaled


def run_federated(name: str, run: FederatedRun, data: Path, held_out: set[int],
                  planned: list[list[int]], held: HeldOut, args: argparse.Namespace
                  ) -> Outcome:
    shutil.rmtree(args.out / name, ignore_errors=True)
    started = time.perf_counter()
    server = RunningServer.start(run_config(name, run, data, args), grpc_port=0, http_port=0)
    try:
        options = [FederatedOptions(
            server=f"127.0.0.1:{server.grpc_port}", tier=tier, name=f"{name}{i}-t{tier}",
            join_token=TOKEN, state_dir=args.out / name / "clients" / str(i), data=data,
            progress=False, also_train=run.also_train) for i, tier in enumerate(run.clients)]
        # the attacker, if any, is the first client: at tier 0 it covers every weight; the
        # flipped one is the last
        clients = [_Attacking(o, args.attack_scale, log=lambda line: None)
                   if i == 0 and args.attack_scale is not None
                   else _Attacking(o, -1.0, log=lambda line: None)
                   if run.flipped and i == len(run.tiers)
                   else _Recording(o, log=lambda line: None) for i, o in enumerate(options)]
        summaries: list[ClientSummary | BaseException] = [None] * len(clients)

        def play(i: int) -> None:
            try:
                summaries[i] = clients[i].run()
            except BaseException as err:  # re-raised below, in the main thread
                summaries[i] = err

        threads = [threading.Thread(target=play, args=(i,)) for i in range(len(clients))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        coordinator = server.service.coordinator
        position, tokens = coordinator.queue.position, coordinator.state.tokens
        flipped = flipped_record(coordinator, options[-1].name) if run.flipped else None
    finally:
        server.stop()
    seconds = time.perf_counter() - started
    if run.flipped and isinstance(summaries[-1], Excluded):
        summaries.pop()  # what scores are for
    for summary in summaries:
        if isinstance(summary, BaseException):
            raise summary
    if [s.tier for s in summaries] != list(run.clients)[:len(summaries)]:
        raise RuntimeError(f"run {name}: clients got tiers {[s.tier for s in summaries]}")
    trained = {i for c in clients for i in c.trained}
    if trained & held_out:
        raise RuntimeError(f"run {name} trained on {len(trained & held_out)} held-out sequences")
    plan = {i for r in planned for i in r}
    # an excluded client's work of the round then open went back to the queue, so the run
    # trained that much less of the plan
    short = run.flipped and flipped["excluded_after_round"] is not None
    if (position > len(plan) or not trained <= plan) if short else (
            position != len(plan) or trained != plan):
        raise RuntimeError(f"run {name} did not train on the planned sequences (a client "
                           "missed a round's deadline?)")
    checkpoints = args.out / name / "checkpoints"
    return Outcome(tokens=tokens, seconds=seconds, summaries=summaries, flipped=flipped,
                   initial=held.start(load_pretrained(checkpoints / "round-0")),
                   final=held.final(load_pretrained(checkpoints / f"round-{len(planned)}")))


def initial_model(args: argparse.Namespace) -> tuple[torch.nn.Module, str]:
    """The coordinator's round-0 weights, and how D's start was obtained: a federated run of
    this invocation's round-0 checkpoint (one left in the output folder by an earlier
    invocation may be of another seed)."""
    torch.manual_seed(args.seed)
    seeded = build_model(ModelConfig(**TINY, vocab_size=260))
    asked = {n.strip().upper() for n in args.runs.split(",")}
    for name in (n for n in RUNS if n in asked):
        checkpoint = args.out / name / "checkpoints" / "round-0"
        if checkpoint.is_dir():
            start = load_pretrained(checkpoint)
            same = all(torch.equal(a, b) for a, b in zip(
                canonical_state_dict(start).values(), canonical_state_dict(seeded).values(),
                strict=True))
            return start, (f"run {name}'s round-0 checkpoint (a model built after "
                           f"torch.manual_seed({args.seed}) is {'' if same else 'NOT '}"
                           "bit-identical to it)")
    return seeded, f"torch.manual_seed({args.seed}), as the coordinator initialises"


def run_standalone(reader: SequenceReader, planned: list[list[int]],
                   held: HeldOut, args: argparse.Namespace, batch_tokens: int,
                   name: str) -> tuple[Outcome, str]:
    started = time.perf_counter()
    model, start = initial_model(args)
    ids = [i for r in planned for i in r]
    examples = [torch.from_numpy(reader[i].astype(np.int64)) for i in ids]
    # sort_window=0: in the order the rounds took them
    steps = plan_batches([len(e) for e in examples], batch_tokens, sort_window=0)
    optimizer = OptimizerConfig(
        name="adamw", lr=args.adamw_lr, final_lr=args.adamw_lr / 10, weight_decay=0.01,
        warmup_steps=max(1, len(steps) // 10), total_steps=len(steps)).build(model)
    runner = MicrobatchRunner(model, AdaptiveLimitsConfig(max_tokens=args.batch_tokens).build())
    schedule = TierSchedule(tiers=TIERS, mode="all")
    initial = held.start(model)
    for step, rows in enumerate(steps):
        train_step_on_examples(runner, optimizer, [examples[i] for i in rows], schedule, step,
                               max_grad_norm=1.0)
    final = held.final(model)
    tokens = sum(len(e) for e in examples)
    note = f"{name}: {len(steps)} AdamW steps of <= {batch_tokens} tokens; start: {start}"
    return Outcome(tokens, initial, final, time.perf_counter() - started, []), note


def _per_round(summaries: list[ClientSummary], field: str, rounds: str) -> str:
    if not summaries:
        return "-"
    each = [asdict(s)[field] / max(1, asdict(s)[rounds]) / 1024 for s in summaries]
    return f"{np.mean(each):,.1f}"


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    names = [n.strip().upper() for n in args.runs.split(",")]
    unknown = set(names) - {*RUNS, STANDALONE, DATA_PARALLEL}
    if unknown:
        raise SystemExit(f"--runs: unknown {sorted(unknown)}; choose from {NAMES}")
    data = data_path(args.documents)
    with Mdat.open(data) as mdat:
        # Every run's coordinator hands out the same order: A's config stands for them all.
        reader, order = work_order(mdat, run_config("A", RUNS["A"], data, args))
        held_out = order.held_out  # the run's held-out tail (modeling.run_order)
        planned = planned_rounds(order, reader, args.rounds, args.tokens_per_round)
        local = planned_rounds(order, reader, *rounds_of(RUNS["L"], args))
        if max(sum(map(len, planned)), sum(map(len, local))) > len(order.training):
            raise SystemExit(f"{args.rounds} rounds of {args.tokens_per_round} tokens reach "
                             "past the first epoch of the order; lower --rounds or "
                             "--tokens-per-round, or raise --documents.")
        eval_examples = [torch.from_numpy(reader[int(i)].astype(np.int64)) for i in held_out]
    held = HeldOut(eval_examples)
    used = sum(map(len, planned))
    print(f"torch {torch.__version__} | cpu, {torch.get_num_threads()} threads | {data}: "
          f"{order.candidates:,} sequences of <= {args.seq_len} tokens | TINY model | "
          f"{args.rounds} rounds x {args.tokens_per_round:,} tokens: first {used:,} sequences "
          f"of the order (seed {args.seed}); held out: last {len(held_out):,} "
          f"({sum(len(e) for e in eval_examples):,} tokens) | sign lr {args.lr}, warmup "
          f"{args.warmup_rounds}, cosine to lr/10 | AdamW lr {args.adamw_lr}", flush=True)

    outcomes: dict[str, Outcome] = {}
    notes = []
    for name in names:
        if name in RUNS:
            outcomes[name] = run_federated(name, RUNS[name], data, {int(i) for i in held_out},
                                           local if RUNS[name].local_steps else planned, held,
                                           args)
        else:
            batch = args.batch_tokens * (DP_WORKERS if name == DATA_PARALLEL else 1)
            outcomes[name], note = run_standalone(reader, planned, held, args, batch, name)
            notes.append(note)
        o = outcomes[name]
        print(f"run {name} done in {o.seconds:,.0f} s: final "
              + ", ".join(f"tier {t} {loss:.3f}" for t, loss in o.final.items()), flush=True)

    labels = [tier_label(t) for t in TIERS]
    print()
    print_table(
        ["run", "tokens", *(f"tier {t} initial -> final" for t in labels),
         "sent KiB/client/round", "update KiB/round", "wall s"],
        [[name, f"{o.tokens:,}", *(f"{o.initial[t]:.3f} -> {o.final[t]:.3f}" for t in labels),
          _per_round(o.summaries, "bytes_sent", "rounds_trained"),
          _per_round(o.summaries, "update_bytes", "rounds_applied"), f"{o.seconds:,.0f}"]
         for name, o in outcomes.items()],
    )
    print(f"initial weights bit-identical across runs: {'yes' if len(held.starts) == 1 else 'NO'}")
    for name, o in outcomes.items():
        if o.summaries:
            each = ", ".join(f"tier {s.tier} {s.bytes_sent / max(1, s.rounds_trained) / 1024:,.1f}"
                             for s in o.summaries)
            print(f"{name}: sent KiB/round by client: {each}")
            busy = ", ".join(f"tier {s.tier} {s.compute_s / max(s.wall_s, 1e-9):.0%}"
                             for s in o.summaries)
            print(f"{name}: share of each client's wall time spent computing: {busy}")
    for note in notes:
        print(note)
    for name, o in outcomes.items():
        if o.flipped is not None:
            scores, after = o.flipped["scores"], o.flipped["excluded_after_round"]
            print(f"{name}: the flipped client's scores "
                  + (" ".join(f"{score:+.2f}" for score in scores)
                     + f" (mean {sum(scores) / len(scores):+.2f})" if scores else "none")
                  + ("; it stayed to the end" if after is None
                     else f"; excluded when round {after} closed"))
    for first, other in [("A", "B"), ("A", "C"), ("A", STANDALONE), ("A", "E"),
                         ("L", STANDALONE), ("L", DATA_PARALLEL), ("LB", DATA_PARALLEL),
                         ("LT", DATA_PARALLEL),
                         ("L", "LB"), ("L", "A"), ("O", "L"), ("AF", "A"), ("AU", "A"), ("LF", "L"),
                         ("LU", "L")]:
        if first in outcomes and other in outcomes:
            ratios = ", ".join(
                f"tier {t} {outcomes[first].final[t] / outcomes[other].final[t]:.3f}"
                for t in labels)
            print(f"final loss {first} / {other}: {ratios} (< 1: {first} is better)")
    steps = len(plan_batches([len(reader[i]) for r in planned for i in r], args.batch_tokens,
                             sort_window=0))
    parameters = sum(p.numel() for p in build_model(ModelConfig(**TINY, vocab_size=260))
                     .parameters())
    # ring all-reduce of float32 gradients: each worker sends and receives 2(N-1)/N of them
    dp_each_way = steps * 4 * parameters * 2 * (DP_WORKERS - 1) / DP_WORKERS
    if "L" in outcomes:
        moved = float(np.mean([s.bytes_up + s.bytes_down for s in outcomes["L"].summaries]))
        print(f"L moved {moved / 2**20:,.2f} MiB per client (up + down, whole run); "
              f"data-parallel training of D's {steps} steps among {DP_WORKERS} workers moves "
              f"{2 * dp_each_way / 2**20:,.1f} MiB per worker: {2 * dp_each_way / moved:,.0f}x "
              "more")
    if args.json is not None:
        report = {name: {"final": {str(t): o.final[tier_label(t)] for t in TIERS},
                         "bytes_up": _bytes(o.summaries, "bytes_up", "rounds_trained"),
                         "bytes_down": _bytes(o.summaries, "bytes_down", "rounds_applied"),
                         "tokens": o.tokens, "seconds": round(o.seconds, 1),
                         **({} if o.flipped is None else {"flipped": o.flipped})}
                  for name, o in outcomes.items()}
        if STANDALONE in report:  # no messages: what data parallelism would move instead
            report[STANDALONE]["data_parallel"] = {
                "workers": DP_WORKERS, "steps": steps, "bytes_up": dp_each_way,
                "bytes_down": dp_each_way}
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.json}")


def _bytes(summaries: list[ClientSummary], field: str, rounds: str) -> float | None:
    """Mean over clients of ``field`` bytes per round (None for a standalone run)."""
    if not summaries:
        return None
    return float(np.mean([asdict(s)[field] / max(1, asdict(s)[rounds]) for s in summaries]))


if __name__ == "__main__":
    main()
