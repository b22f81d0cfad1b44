"""Neuron ordering (`matformer-convert`): how much better are the tier slices of a dense
model once its FFN neurons are sorted by importance, and does it still show after a short
MatFormer finetune, standalone and federated?

1. **pretrain** ``client.standalone.TINY`` (hidden 128, 4 layers, FFN 512, bytes) at tier 0
   only, on ``--tokens`` of the embedded docstrings corpus in sequences of up to 256 tokens:
   a dense model whose FFN neurons lie in no order. Training is ``matformer-train``'s
   machinery as ``tier_quality.py`` runs it (token-budget batches of ``--batch-tokens``,
   AdamW with 10% warmup and cosine to lr/10, clip 1.0). Its tokens come after the first
   ``--finetune-tokens`` of the run's order, which both finetunes train, so neither
   finetune sees a sequence pretraining saw.
2. **convert** it (saved, then ``modeling.checkpoint.neuron_order.convert``, what
   ``matformer-convert`` runs) by the ``weights`` score and by the ``activations`` score on
   the first ``--calibration-sequences`` of the run's order (its default). The three models
   (``unordered``: the saved dense model, loaded back) compute the same function at tier 0.
3. **before**: held-out loss at tiers 0, 1, 2 of each: the first ``--eval-sequences`` of the
   shuffle's last 5%, the tail ``matformer-train``, ``matformer-eval`` and the coordinator
   hold out, never trained on.
4. **after**: each of the three finetuned standalone on the first ``--finetune-tokens`` of
   the run's order, the same batches for all, with tiers 0, 1, 2 trained every step and
   their losses summed (``matformer-train --tiers 0,1,2``, ``TierSchedule(mode="all")``),
   then evaluated again.
5. **federated**: each of the three finetuned by a real federated run, ``local-testnet``
   in a subprocess: a coordinator whose first master is the model's checkpoint
   (``[model] checkpoint``) and three members at tiers 0, 1, 2, for ``--rounds`` rounds that
   share ``--finetune-tokens`` (so at most as many tokens as the standalone finetune, from
   the same order: ``[data]`` is the bench's container, strategy, 256 tokens and seed, which
   the bench checks gives its own order and held-out tail). Members take local steps
   (``[inner]``: AdamW batches of ``--inner-batch-tokens`` at a constant ``--inner-lr``,
   weight decay 0.01), send dense pseudo-gradients, and the coordinator averages them
   (``[update]`` sgd, lr 1.0). The run's last checkpoint is evaluated like the others. Each
   token trains one tier here, where the standalone finetune trains it at all three. (DeMo's
   compression and DiLoCo's outer step each made tier 0 worse in so short a run:
   bench/README.md, "Neuron order".)

Ratios are ordered / unordered held-out loss at each tier (< 1: ordering helps). JSON
(``--json``): ``settings``, ``before``, ``after`` and ``federated``, each ``{unordered,
weights, activations}`` → ``{tier0, tier1, tier2}`` held-out loss, ``kept`` (the share of
each score the ordered tier-1 and tier-2 prefixes hold, against unordered), ``seconds``.

    python bench/neuron_order.py --threads 1 --json runs/neuron_order.json   # about 7 min
    python bench/neuron_order.py --smoke                                      # it runs
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import numpy as np
import torch
from harness import parse, print_table
from tier_quality import evaluate, seeded_model, token_stream, train

from matformer.client.standalone import TINY, sequences
from matformer.modeling import ModelConfig
from matformer.modeling.checkpoint import load_pretrained, save_pretrained
from matformer.modeling.checkpoint.neuron_order import Calibration, convert
from matformer.modeling.matformer import layer_widths
from matformer.modeling.mdat import DEFAULT_STRATEGY, Mdat, build_default_mdat, default_data_path
from matformer.modeling.run_order import RunOrder
from matformer.modeling.training import TierSchedule
from matformer.server.config import RunConfig
from matformer.server.work import work_order

TIERS = [0, 1, 2]
SEQ_LEN = 256
STRATEGY = DEFAULT_STRATEGY["strategy_name"]
RUNS = ("unordered", "weights", "activations")
STAGES = ("before", "after", "federated")
# One federated finetune: each starts four processes (about 30 s on two shared cores).
SMOKE = dict(tokens=2500, finetune_tokens=1000, documents=40, eval_sequences=6,
             calibration_sequences=4, federated="unordered", rounds=1, threads=1)
# The federated finetune's run.toml; keys as in examples/run.toml. The outer step averages
# the members' dense pseudo-gradients (local-testnet's default run's [update]).
RUN_TOML = """\
auth = "none"
[run]
id = "neuron-order-{name}"
dir = "run"
[model]
checkpoint = "{checkpoint}"
[data]
path = "{data}"
strategy = "{strategy}"
max_seq_len = {seq_len}
seed = {seed}
[tiers]
allowed = {tiers}
[round]
min_clients = {clients}
tokens_per_round = {tokens_per_round}
rounds = {rounds}
[compression]
encoding = "dense"
[update]
rule = "sgd"
lr = 1.0
schedule = "constant"
[inner]
batch_tokens = {inner_batch_tokens}
lr = {inner_lr}
weight_decay = 0.01
[checkpoint]
every_rounds = {rounds}
[tracking]
kind = "none"
"""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=400_000, help="pretraining, tier 0 only")
    parser.add_argument("--finetune-tokens", type=int, default=60_000,
                        help="each model's finetune at tiers 0, 1, 2 (standalone, federated)")
    parser.add_argument("--batch-tokens", type=int, default=2048,
                        help="padded tokens per optimizer step")
    parser.add_argument("--lr", type=float, default=2e-3, help="pretraining AdamW peak lr")
    parser.add_argument("--finetune-lr", type=float, default=5e-4)
    parser.add_argument("--federated", default=",".join(RUNS),
                        help="the models given a federated finetune too, comma-separated")
    parser.add_argument("--rounds", type=int, default=15, help="of each federated finetune")
    parser.add_argument("--inner-batch-tokens", type=int, default=512,
                        help="federated members' tokens per local AdamW step")
    parser.add_argument("--inner-lr", type=float, default=5e-4)
    parser.add_argument("--calibration-sequences", type=int, default=64)
    parser.add_argument("--eval-sequences", type=int, default=96,
                        help="held-out sequences evaluated (the first of the held-out tail)")
    parser.add_argument("--documents", type=int, default=None,
                        help="docstrings in the corpus (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="shuffle and initial weights")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: every core the process may use)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    args = parse(parser, SMOKE)
    args.federated = [name for name in args.federated.split(",") if name]
    if not set(args.federated) <= set(RUNS):
        parser.error(f"--federated takes names of {', '.join(RUNS)}")
    return args


def ordered_models(dense: torch.nn.Module, data: Path, folder: Path,
                   args: argparse.Namespace) -> tuple[dict[str, torch.nn.Module], dict]:
    """The dense model saved and loaded back, and its two conversions, by name (each also a
    checkpoint ``folder/<name>``); and per score the share of it that the tier-1 and tier-2
    prefixes hold, (unordered, ordered)."""
    save_pretrained(dense, folder / "unordered")
    models = {"unordered": load_pretrained(folder / "unordered")}
    kept = {}
    calibrations = {"weights": None, "activations": Calibration(
        data, args.calibration_sequences, STRATEGY, None, SEQ_LEN, args.seed)}
    for score, calibration in calibrations.items():
        done = convert(folder / "unordered", folder / score, calibration=calibration)
        models[score] = load_pretrained(folder / score)
        kept[score] = {f"tier{t}": done.kept(layer_widths(dense.config, t)) for t in TIERS[1:]}
    return models, kept


def by_tier(losses: dict[str, float]) -> dict[str, float]:
    return {f"tier{label}": loss for label, loss in losses.items()}


def run_toml(name: str, checkpoint: Path, data: Path, args: argparse.Namespace) -> Path:
    """``<checkpoint>-federated/run.toml``: the federated finetune of that checkpoint."""
    folder = checkpoint.with_name(f"{checkpoint.name}-federated")
    folder.mkdir()
    path = folder / "run.toml"
    path.write_text(RUN_TOML.format(
        name=name, checkpoint=checkpoint.resolve().as_posix(), data=data.resolve().as_posix(),
        strategy=STRATEGY, seq_len=SEQ_LEN, seed=args.seed, tiers=TIERS, clients=len(TIERS),
        tokens_per_round=math.ceil(args.finetune_tokens / args.rounds), rounds=args.rounds,
        inner_batch_tokens=args.inner_batch_tokens, inner_lr=args.inner_lr))
    return path


def federated_finetune(path: Path, order: RunOrder) -> tuple[Path, dict]:
    """``local-testnet`` on the run of ``path``, members at tiers 0, 1, 2: the run's last
    checkpoint and the testnet's summary.json. Its log goes to ``testnet.log`` beside. First
    it checks that the run trains ``order`` and holds out its tail, as the coordinator reads
    them (``server.work.work_order``)."""
    config = RunConfig.from_dict(tomllib.loads(path.read_text()), base=path.parent)
    with Mdat.open(config.data.path) as mdat:
        _, federated = work_order(mdat, config)
    assert np.array_equal(federated.held_out, order.held_out), "held-out tails differ"
    assert np.array_equal(federated.training, order.training), "training orders differ"
    log = path.with_name("testnet.log")
    # The testnet evaluates its checkpoints on every core; on a shared machine OpenMP's
    # spinning threads then take 6x as long as threads that sleep while they wait.
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"}
    with log.open("w") as out:
        done = subprocess.run(
            [sys.executable, "-m", "matformer.local_testnet.main", "--config", str(path),
             "--num-clients", str(len(TIERS)), "--tiers", ",".join(map(str, TIERS))],
            cwd=path.parent, env=env, stdout=out, stderr=subprocess.STDOUT)
    run = path.with_name("run")
    # exit 1 with a summary: the run finished, but some tier's held-out loss did not fall
    # below its start; that is a figure here, not a failure
    if done.returncode != 0 and not (run / "summary.json").is_file():
        raise RuntimeError(f"local-testnet failed ({done.returncode}):\n"
                           + "\n".join(log.read_text().splitlines()[-30:]))
    last = max(int(p.name.removeprefix("round-")) for p in (run / "checkpoints").glob("round-*")
               if p.name.removeprefix("round-").isdigit())
    return run / "checkpoints" / f"round-{last}", json.loads((run / "summary.json").read_text())


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    started = time.perf_counter()
    config = ModelConfig(**TINY)
    data = default_data_path(args.documents)
    with build_default_mdat(data, limit=args.documents) as mdat:
        reader = mdat.sequences(STRATEGY, SEQ_LEN)
        lengths = reader.lengths().copy()
        order = RunOrder.of(mdat.shuffle(None, STRATEGY, SEQ_LEN, args.seed), lengths, config,
                            args.seed)
        # the finetunes' tokens first: a federated run hands out its order from the start
        stream = token_stream(order, lengths, args.finetune_tokens + args.tokens)
        finetune = len(token_stream(order, lengths, args.finetune_tokens))
        examples = sequences(reader, stream, torch.device("cpu"))
        held_out = sequences(reader, order.held_out[:args.eval_sequences], torch.device("cpu"))
    finetuning, pretraining = examples[:finetune], examples[finetune:]
    print(f"torch {torch.__version__} | cpu, {torch.get_num_threads()} threads | {data}: "
          f"{order.candidates:,} sequences of <= {SEQ_LEN} bytes | TINY: hidden "
          f"{config.hidden_size}, {config.num_hidden_layers} layers, FFN "
          f"{config.intermediate_size} | held out: {len(held_out)} sequences, "
          f"{sum(map(len, held_out)):,} tokens", flush=True)

    seconds = {}
    dense = seeded_model(config, args.seed)
    steps = train(dense, pretraining, TierSchedule(tiers=[0]), args)
    seconds["pretrain"] = time.perf_counter() - started
    print(f"pretrained at tier 0: {steps} steps, {sum(map(len, pretraining)):,} tokens, "
          f"{seconds['pretrain']:,.0f} s", flush=True)
    finetune_args = argparse.Namespace(batch_tokens=args.batch_tokens, lr=args.finetune_lr)
    losses = {stage: {} for stage in STAGES}
    federated_tokens = {}
    with tempfile.TemporaryDirectory() as folder:
        mark = time.perf_counter()
        models, kept = ordered_models(dense, data, Path(folder), args)
        seconds["convert"] = time.perf_counter() - mark
        losses["before"] = {name: by_tier(evaluate(m, held_out, TIERS))
                            for name, m in models.items()}
        mark = time.perf_counter()
        for name, model in models.items():
            train(model, finetuning, TierSchedule(tiers=TIERS, mode="all"), finetune_args)
            losses["after"][name] = by_tier(evaluate(model, held_out, TIERS))
            report(f"finetuned {name}", losses["after"][name])
        seconds["finetune"] = time.perf_counter() - mark
        for name in args.federated:
            mark = time.perf_counter()
            last, summary = federated_finetune(run_toml(name, Path(folder) / name, data, args),
                                               order)
            losses["federated"][name] = by_tier(evaluate(load_pretrained(last), held_out, TIERS))
            federated_tokens[name] = summary["tokens"]
            seconds[f"federated_{name}"] = time.perf_counter() - mark
            report(f"federated {name}: {summary['rounds']} rounds, {summary['tokens']:,} "
                   f"tokens, {seconds[f'federated_{name}']:,.0f} s", losses["federated"][name])
    seconds["total"] = time.perf_counter() - started
    summarize(losses, kept, config, args, seconds,
              tokens={"pretrain": sum(map(len, pretraining)),
                      "finetune": sum(map(len, finetuning)), "federated": federated_tokens})


def report(what: str, losses: dict[str, float]) -> None:
    print(f"{what}: " + ", ".join(f"{t} {v:.4f}" for t, v in losses.items()), flush=True)


def summarize(losses: dict[str, dict], kept: dict, config: ModelConfig,
              args: argparse.Namespace, seconds: dict, tokens: dict) -> None:
    rows = []
    for stage in STAGES:
        for tier in TIERS:
            key = f"tier{tier}"
            loss = {run: losses[stage][run][key] for run in RUNS if run in losses[stage]}
            base = loss.get("unordered")
            rows.append([stage, str(tier), str(config.intermediate_size >> tier),
                         *(f"{loss[run]:.4f}" if run in loss else "-" for run in RUNS),
                         *(f"{loss[run] / base:.3f}" if run in loss and base else "-"
                           for run in RUNS[1:])])
    print()
    print_table(["stage", "tier", "FFN", *RUNS, "weights/unordered", "activations/unordered"],
                rows)
    for score, shares in kept.items():
        print(f"{score} score held by the prefix, unordered -> ordered: " + ", ".join(
            f"{tier} {a:.1%} -> {b:.1%}" for tier, (a, b) in shares.items()))
    print("ratios: ordered / unordered held-out loss (< 1: the ordered slice is better); "
          f"before: after pretraining at tier 0 only ({tokens['pretrain']:,} tokens); after: "
          f"+{tokens['finetune']:,} tokens at tiers 0,1,2 summed; federated: +"
          f"{'/'.join(f'{n:,}' for n in sorted(set(tokens['federated'].values())))} tokens "
          f"in {args.rounds} rounds, one member at each of tiers 0,1,2")
    print(f"wall: {seconds['total']:,.0f} s")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "smoke")}
        figures = {"settings": {**settings, "model": TINY, "seq_len": SEQ_LEN,
                                "tokens": tokens, "torch": torch.__version__},
                   **losses, "kept": kept, "seconds": seconds}
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
