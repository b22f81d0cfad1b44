"""Tier quality at the MatFormer paper's budget: held-out loss per tier of three trainings.

The model is one where FFN width matters (defaults: hidden 256, FFN 4x = 1,024, 4 layers,
5.2M parameters at tier 0), on the stdlib docstrings with a byte-level BPE of
``--vocab-size`` trained on them (``modeling.tokenizers.train_tokenizer``), cut into
sequences of up to 256 tokens. Tier ``t`` is the first ``1024 / 2**t`` FFN neurons.

  joint         MatFormer training of tiers 0, 1, 2 on ``--tokens`` tokens; each step
                trains one tier drawn uniformly (``TierSchedule(mode="sample")``, the
                paper's recipe), so every tier gets a third of the steps on average and the
                run costs what the three ``independent`` models cost together.
                ``--joint-mode all`` sums the three tiers' losses every step instead (the
                paper's public code): the same tokens at about three times the compute.
  tier0_sliced  tier 0 alone on the same tokens in the same batches from the same initial
                weights as ``joint``, then evaluated at tiers 0, 1, 2 by slicing: what
                MatFormer slices are worth when the model was never trained to have them.
  independent   for each tier a plain model of that tier's size (intermediate_size
                ``1024 / 2**t``), trained alone on an equal share, ``--tokens / 3``: the
                first third of the same token stream, the same for all three models (each
                built after ``torch.manual_seed(--seed)``). ``joint``'s tokens are thus
                those of the three together.

All runs use the training machinery of ``matformer-train`` (``client.standalone``):
token-budget batches of ``--batch-tokens`` padded tokens (``plan_batches``), each one AdamW
step (``OptimizerConfig``: weight decay 0.01, 10% warmup, cosine to lr/10, gradient clip 1.0)
through ``train_step_on_examples``. The token stream is the training sequences in the
container's shuffle of ``--seed``, then reshuffled for each further epoch. Held out: the
shuffle's last 5%, as ``matformer-train`` holds out, never trained on by any run; losses are
the mean per target token over it (``modeling.training.held_out_loss``). The tokenizer is trained
on the whole corpus, held-out text included; all runs share it, so it favours none of them.

Targets (reported, not asserted): under ``joint`` tier 0 < tier 1 < tier 2, and ``joint``'s
tier 2 no worse than the ``independent`` model of that size. The container, tokenizer and
pretokenized sequences are kept in ``--dir`` and reused.

    python bench/tier_quality.py --json tier_quality.json     # defaults (12 min on 2 cores)
    python bench/tier_quality.py --smoke                      # tiny sizes: it runs
    python bench/tier_quality.py --joint-mode all             # joint costs 3x (about 19 min)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from harness import parse, print_table
from torch import Tensor

from matformer.client.standalone import sequences
from matformer.modeling import ModelConfig, build_model
from matformer.modeling.batching import AdaptiveLimitsConfig, MicrobatchRunner, plan_batches
from matformer.modeling.matformer import tier_label
from matformer.modeling.mdat import Mdat, build_default_mdat
from matformer.modeling.optim import OptimizerConfig
from matformer.modeling.run_order import RunOrder
from matformer.modeling.tokenizers import train_tokenizer
from matformer.modeling.training import (
    TierSchedule,
    held_out_loss,
    train_step_on_examples,
)
from matformer.scripts.slice_mix import mixes

TIERS = [0, 1, 2]
CPU = torch.device("cpu")  # where this benchmark trains
EVAL_BATCH_TOKENS = 8192  # padded tokens per evaluation microbatch
SEQ_LEN = 256  # tokens per sequence at most; the strategy cuts documents every 128
SPECIAL = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2, mask_token_id=3)  # the BPE's
SMOKE = dict(hidden_size=32, layers=2, vocab_size=300, tokens=6000, documents=100, threads=1,
             joint_mixes=1, slice_budget=0.6)


@dataclass
class Result:
    """One training: held-out loss per tier label, tokens trained, steps and wall time."""

    losses: dict[str, float]
    tokens: int
    steps: int
    seconds: float


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ffn-ratio", type=int, default=4, help="tier-0 FFN width / hidden")
    parser.add_argument("--vocab-size", type=int, default=2048, help="BPE vocabulary")
    parser.add_argument("--tokens", type=int, default=1_000_000,
                        help="joint's and tier0_sliced's tokens; each independent model "
                             "trains a third, or all of them under --independent-tokens all")
    parser.add_argument("--independent-tokens", choices=["share", "all"], default="share",
                        help="each independent model trains a third of --tokens (joint "
                             "then costs what the three cost together) or all of them (the "
                             "paper's baselines: as many tokens as the MatFormer model)")
    parser.add_argument("--runs", default="joint,tier0_sliced,independent",
                        help="which trainings, comma-separated")
    parser.add_argument("--batch-tokens", type=int, default=1024,
                        help="padded tokens per optimizer step")
    parser.add_argument("--lr", type=float, default=2e-3, help="AdamW's peak lr")
    parser.add_argument("--joint-mode", choices=["sample", "all"], default="sample",
                        help="joint: one tier drawn per step, or all tiers' losses summed")
    parser.add_argument("--joint-weights", type=lambda s: [float(w) for w in s.split(",")],
                        default=None, help="with --joint-mode all: each tier's loss weight, "
                                           "comma-separated (default 1 each)")
    parser.add_argument("--joint-mixes", type=int, default=0,
                        help="joint: per-layer mixes drawn each step besides the tiers "
                             "(TierSchedule(mixes=N), matformer train --tier-mixes N)")
    parser.add_argument("--slice-budget", type=float, default=None,
                        help="after joint: every Mix'n'Match slice within this share of the "
                             "FFN measured, the best against the best uniform tier within it")
    parser.add_argument("--seed", type=int, default=0, help="shuffle, init and tier draws")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: every core the process may use)")
    parser.add_argument("--dir", type=Path, default=Path("runs/tier_quality"),
                        help="the BPE container and tokenizer (built on first use)")
    parser.add_argument("--documents", type=int, default=None,
                        help="docstrings in the corpus (default: all)")
    parser.add_argument("--json", type=Path, default=None,
                        help="write the held-out loss per tier of each run")
    return parse(parser, SMOKE)


def bpe_sequences(folder: Path, vocab_size: int, documents: int | None) -> tuple[Mdat, str]:
    """The docstrings container in ``folder`` (the first ``documents``, default all) and its
    BPE strategy's name, built on first use: the container (``build_default_mdat``), a BPE
    trained on it, and the strategy."""
    corpus = "python_docs" if documents is None else f"python_docs-{documents}"
    mdat = build_default_mdat(folder / f"{corpus}.mdat", limit=documents)
    name = f"bpe{vocab_size}"
    if name not in {s.name for s in mdat.strategies()}:
        tokenizer = train_tokenizer(mdat.submdat("python_docs"),
                                    folder / f"{corpus}-{name}" / "tokenizer.json",
                                    vocab_size=vocab_size)
        mdat.add_strategy({"strategy_name": name, "tokenizer_type": "huggingface",
                           "tokenizer_name": str(tokenizer), "chunk_size": 128,
                           "splitter_class": "fixed_chunks", "bos_token_id": 1,
                           "eos_token_id": 2})
    mdat.pretokenize(name)
    return mdat, name


def model_config(args: argparse.Namespace, intermediate_size: int) -> ModelConfig:
    heads = max(1, args.hidden_size // 64)
    return ModelConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                       num_hidden_layers=args.layers, num_attention_heads=heads,
                       intermediate_size=intermediate_size, max_position_embeddings=SEQ_LEN,
                       **SPECIAL)


def token_stream(order: RunOrder, lengths: np.ndarray, tokens: int) -> np.ndarray:
    """The first sequences of the run's training stream holding ``tokens`` tokens: its
    epochs one after another (``RunOrder.epoch``, as ``matformer-train`` takes them)."""
    epochs = [order.epoch(0)]
    while lengths[np.concatenate(epochs)].sum() < tokens:
        epochs.append(order.epoch(len(epochs)))
    stream = np.concatenate(epochs)
    return stream[:int(np.searchsorted(np.cumsum(lengths[stream]), tokens)) + 1]


def train(model: torch.nn.Module, examples: list[Tensor], schedule: TierSchedule,
          args: argparse.Namespace) -> int:
    """AdamW over ``examples`` in token-budget batches, as ``matformer-train`` steps; the
    number of steps."""
    plan = plan_batches([len(e) for e in examples], args.batch_tokens)
    optimizer = OptimizerConfig(
        name="adamw", lr=args.lr, final_lr=args.lr / 10, weight_decay=0.01,
        warmup_steps=max(1, len(plan) // 10), total_steps=len(plan)).build(model)
    runner = MicrobatchRunner(model, AdaptiveLimitsConfig(max_tokens=args.batch_tokens).build())
    for step, rows in enumerate(plan):
        train_step_on_examples(runner, optimizer, [examples[i] for i in rows], schedule, step,
                               max_grad_norm=1.0)
    return len(plan)


def evaluate(model: torch.nn.Module, held_out: list[Tensor], tiers: list[int]
             ) -> dict[str, float]:
    return held_out_loss(model, held_out, tiers, batch_tokens=EVAL_BATCH_TOKENS)


def run(model: torch.nn.Module, examples: list[Tensor], schedule: TierSchedule,
        held_out: list[Tensor], tiers: list[int], args: argparse.Namespace) -> Result:
    started = time.perf_counter()
    steps = train(model, examples, schedule, args)
    return Result(losses=evaluate(model, held_out, tiers), tokens=sum(map(len, examples)),
                  steps=steps, seconds=time.perf_counter() - started)


def seeded_model(config: ModelConfig, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(config)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))
    started = time.perf_counter()
    widths = [args.hidden_size * args.ffn_ratio >> t for t in TIERS]
    universal = model_config(args, widths[0])
    mdat, strategy = bpe_sequences(args.dir, args.vocab_size, args.documents)
    with mdat:
        reader = mdat.sequences(strategy, SEQ_LEN)
        lengths = reader.lengths().copy()
        order = RunOrder.of(mdat.shuffle(None, strategy, SEQ_LEN, args.seed), lengths,
                            universal, args.seed)  # as matformer-train orders and holds out
        held_ids = order.held_out
        examples = sequences(reader, token_stream(order, lengths, args.tokens), CPU)
        held_out = sequences(reader, held_ids, CPU)
    # Each independent model trains the stream's first third, so joint's tokens are theirs
    # together, or (the paper's baselines) the whole stream
    share = (examples if args.independent_tokens == "all" else
             examples[:len(token_stream(order, lengths, args.tokens // len(TIERS)))])
    runs = args.runs.split(",")
    if unknown := set(runs) - {"joint", "tier0_sliced", "independent"}:
        raise SystemExit(f"--runs: no training named {', '.join(sorted(unknown))}; pick from "
                         "joint, tier0_sliced, independent")
    tokens = sum(map(len, examples))
    print(f"torch {torch.__version__} | cpu, {torch.get_num_threads()} threads | "
          f"{args.dir}: BPE {args.vocab_size}, {order.candidates:,} sequences of <= {SEQ_LEN} "
          f"tokens; held out: last {len(held_ids):,} ({lengths[held_ids].sum():,} tokens) | "
          f"hidden {args.hidden_size}, {args.layers} layers, FFN {widths[0]} | {tokens:,} "
          f"tokens ({tokens / lengths[order.training].sum():.2f} epochs) in batches of <= "
          f"{args.batch_tokens:,}, AdamW lr {args.lr} | joint: {args.joint_mode}", flush=True)

    initial = evaluate(seeded_model(universal, args.seed), held_out, TIERS)
    joint = TierSchedule(tiers=TIERS, mode=args.joint_mode, seed=args.seed,
                         weights=args.joint_weights, mixes=args.joint_mixes)
    results: dict[str, list[Result]] = {}
    sliced: dict | None = None
    for name, schedule in [("joint", joint), ("tier0_sliced", TierSchedule(tiers=[0]))]:
        if name not in runs:
            continue
        model = seeded_model(universal, args.seed)  # joint and tier0_sliced start alike
        results[name] = [run(model, examples, schedule, held_out, TIERS, args)]
        report(name, results[name][0])
        if name == "joint" and args.slice_budget is not None:
            sliced = slice_search(model, held_out, args.slice_budget, args.layers)
    for tier, width in zip(TIERS, widths, strict=True):
        if "independent" not in runs:
            break
        model = seeded_model(model_config(args, width), args.seed)
        outcome = run(model, share, TierSchedule(tiers=[0]), held_out, [0], args)
        outcome.losses = {tier_label(tier): outcome.losses["0"]}  # a plain model of its size
        results.setdefault("independent", []).append(outcome)
        report(f"independent tier {tier} (FFN {width})", outcome)
    summarize(results, initial, widths, joint, args, sliced)
    print(f"wall: {time.perf_counter() - started:,.0f} s")


def slice_search(model: torch.nn.Module, held_out: list[Tensor], budget: float, layers: int
                 ) -> dict:
    """Every mix of the tiers (``matformer slice``'s candidates) within ``budget`` of the FFN
    neurons, measured on the held-out set: the best against the best uniform tier within it."""
    def share(mix: tuple[int, ...]) -> float:
        return sum(2.0 ** -t for t in mix) / len(mix)

    fitting = [m for m in mixes(TIERS, layers) if share(m) <= budget + 1e-12]
    losses = evaluate(model, held_out, [list(m) for m in fitting])
    points = [{"layer_tiers": list(m), "share": share(m), "loss": losses[tier_label(list(m))]}
              for m in fitting]
    best = min(points, key=lambda p: p["loss"])
    uniform = min((p for p in points if len(set(p["layer_tiers"])) == 1),
                  key=lambda p: p["loss"])
    print(f"slices within {budget:.0%} of the FFN, {len(points)} measured: best "
          f"{','.join(map(str, best['layer_tiers']))} at {best['share']:.3f}, loss "
          f"{best['loss']:.4f}; best uniform tier {uniform['layer_tiers'][0]} at "
          f"{uniform['share']:.3f}, {uniform['loss']:.4f} ({best['loss'] / uniform['loss']:.4f})",
          flush=True)
    for point in sorted(points, key=lambda p: p["share"]):
        print(f"  {','.join(map(str, point['layer_tiers'])):<12} {point['share']:.3f} "
              f"{point['loss']:.4f}")
    return {"budget": budget, "points": points, "best": best, "uniform": uniform}


def report(name: str, result: Result) -> None:
    print(f"{name}: {result.steps} steps, {result.tokens:,} tokens, {result.seconds:,.0f} s: "
          + ", ".join(f"tier {t} {loss:.3f}" for t, loss in result.losses.items()), flush=True)


def summarize(results: dict[str, list[Result]], initial: dict[str, float], widths: list[int],
              joint: TierSchedule, args: argparse.Namespace, sliced: dict | None = None
              ) -> None:
    labels = [tier_label(t) for t in TIERS]
    loss = {name: {t: v for r in runs for t, v in r.losses.items()}
            for name, runs in results.items()}
    print()
    print_table(
        ["run", "tokens", "steps", *(f"tier {t} (FFN {w})" for t, w in zip(labels, widths,
                                                                          strict=True)), "s"],
        [["start", "0", "0", *(f"{initial[t]:.4f}" for t in labels), "-"]]
        + [[name, " + ".join(f"{r.tokens:,}" for r in runs),
            " + ".join(str(r.steps) for r in runs), *(f"{loss[name][t]:.4f}" for t in labels),
            f"{sum(r.seconds for r in runs):,.0f}"] for name, runs in results.items()],
    )
    if args.joint_mode == "sample" and "joint" in results:
        drawn = [joint.step_tiers(s, args.layers)[0][0]
                 for s in range(results["joint"][0].steps)]
        print("joint: steps per tier " + ", ".join(f"{t}: {drawn.count(t)}" for t in TIERS))
    for first, other in [("joint", "independent"), ("joint", "tier0_sliced"),
                         ("tier0_sliced", "independent")]:
        if first not in loss or other not in loss:
            continue
        print(f"{first} / {other}: " + ", ".join(
            f"tier {t} {loss[first][t] / loss[other][t]:.3f}" for t in labels)
            + f" (< 1: {first} is better)")
    if "joint" in loss and "independent" in loss:
        ordered = all(loss["joint"][a] < loss["joint"][b]
                      for a, b in itertools.pairwise(labels))
        small = loss["joint"][labels[-1]] <= loss["independent"][labels[-1]]
        print(f"targets: joint tier 0 < 1 < 2: {'met' if ordered else 'NOT met'}; joint tier "
              f"{labels[-1]} <= independent tier {labels[-1]}: {'met' if small else 'NOT met'}")
    if args.json:
        tokens = {name: sum(r.tokens for r in runs) for name, runs in results.items()}
        seconds = {name: sum(r.seconds for r in runs) for name, runs in results.items()}
        config = {k: v for k, v in vars(args).items() if k not in ("json", "dir", "smoke")}
        args.json.write_text(json.dumps({**loss, "initial": initial, "tokens": tokens,
                                         "seconds": seconds, "config": config,
                                         "slice": sliced}, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
