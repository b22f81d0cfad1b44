"""Neuron ordering (`matformer-convert`): how much better are the tier slices of a dense
model once its FFN neurons are sorted by importance, and does it still show after a short
MatFormer finetune?

1. **pretrain** ``client.standalone.TINY`` (hidden 128, 4 layers, FFN 512, bytes) at tier 0
   only, on ``--tokens`` of the embedded docstrings corpus in sequences of up to 256 tokens:
   a dense model whose FFN neurons lie in no order. Training is ``matformer-train``'s
   machinery as ``tier_quality.py`` runs it (token-budget batches of ``--batch-tokens``,
   AdamW with 10% warmup and cosine to lr/10, clip 1.0).
2. **convert** it (saved, then ``modeling.checkpoint.neuron_order.convert``, what
   ``matformer-convert`` runs) by the ``weights`` score and by the ``activations`` score on
   ``--calibration-sequences`` of the training sequences. The three models (``unordered``:
   the saved dense model, loaded back) compute the same function at tier 0.
3. **before**: held-out loss at tiers 0, 1, 2 of each: the first ``--eval-sequences`` of the
   shuffle's last 5%, the tail ``matformer-train`` and ``matformer-eval`` hold out, never
   trained on.
4. **after**: each of the three finetuned on the next ``--finetune-tokens`` of the stream,
   the same batches for all, with tiers 0, 1, 2 trained every step and their losses summed
   (``matformer-train --tiers 0,1,2``, ``TierSchedule(mode="all")``), then evaluated again.

Ratios are ordered / unordered held-out loss at each tier (< 1: ordering helps). JSON
(``--json``): ``settings``, ``before`` and ``after``, each ``{unordered, weights,
activations}`` → ``{tier0, tier1, tier2}`` held-out loss, ``kept`` (the share of each
score the ordered tier-1 and tier-2 prefixes hold, against unordered), ``seconds``.

    python bench/neuron_order.py --threads 1 --json runs/neuron_order.json   # about 6 min
    python bench/neuron_order.py --smoke                                      # it runs
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from harness import parse, print_table
from tier_quality import evaluate, seeded_model, token_stream, train

from client.standalone import TINY, sequences
from modeling import ModelConfig
from modeling.checkpoint import load_pretrained, save_pretrained
from modeling.checkpoint.neuron_order import Calibration, convert
from modeling.matformer import layer_widths
from modeling.mdat import DEFAULT_STRATEGY, build_default_mdat, default_data_path
from modeling.run_order import RunOrder
from modeling.training import TierSchedule

TIERS = [0, 1, 2]
SEQ_LEN = 256
STRATEGY = DEFAULT_STRATEGY["strategy_name"]
RUNS = ("unordered", "weights", "activations")
SMOKE = dict(tokens=2500, finetune_tokens=1000, documents=40, eval_sequences=6,
             calibration_sequences=4, threads=1)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=400_000, help="pretraining, tier 0 only")
    parser.add_argument("--finetune-tokens", type=int, default=60_000,
                        help="each model's finetune at tiers 0, 1, 2")
    parser.add_argument("--batch-tokens", type=int, default=2048,
                        help="padded tokens per optimizer step")
    parser.add_argument("--lr", type=float, default=2e-3, help="pretraining AdamW peak lr")
    parser.add_argument("--finetune-lr", type=float, default=5e-4)
    parser.add_argument("--calibration-sequences", type=int, default=64)
    parser.add_argument("--eval-sequences", type=int, default=96,
                        help="held-out sequences evaluated (the first of the held-out tail)")
    parser.add_argument("--documents", type=int, default=None,
                        help="docstrings in the corpus (default: all)")
    parser.add_argument("--seed", type=int, default=0, help="shuffle and initial weights")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads (default: every core the process may use)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    return parse(parser, SMOKE)


def ordered_models(dense: torch.nn.Module, data: Path, folder: Path,
                   args: argparse.Namespace) -> tuple[dict[str, torch.nn.Module], dict]:
    """The dense model saved and loaded back, and its two conversions, by name; and per
    score the share of it that the tier-1 and tier-2 prefixes hold, (unordered, ordered)."""
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
        stream = token_stream(order, lengths, args.tokens + args.finetune_tokens)
        pretrain = len(token_stream(order, lengths, args.tokens))
        examples = sequences(reader, stream, torch.device("cpu"))
        held_out = sequences(reader, order.held_out[:args.eval_sequences], torch.device("cpu"))
    pretraining, finetuning = examples[:pretrain], examples[pretrain:]
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
    with tempfile.TemporaryDirectory() as folder:
        mark = time.perf_counter()
        models, kept = ordered_models(dense, data, Path(folder), args)
        seconds["convert"] = time.perf_counter() - mark
        before = {name: by_tier(evaluate(m, held_out, TIERS)) for name, m in models.items()}
        mark = time.perf_counter()
        after = {}
        for name, model in models.items():
            train(model, finetuning, TierSchedule(tiers=TIERS, mode="all"), finetune_args)
            after[name] = by_tier(evaluate(model, held_out, TIERS))
            print(f"finetuned {name}: " + ", ".join(f"{t} {v:.4f}" for t, v in
                                                    after[name].items()), flush=True)
        seconds["finetune"] = time.perf_counter() - mark
    seconds["total"] = time.perf_counter() - started
    summarize(before, after, kept, config, args, seconds,
              tokens={"pretrain": sum(map(len, pretraining)),
                      "finetune": sum(map(len, finetuning))})


def summarize(before: dict, after: dict, kept: dict, config: ModelConfig,
              args: argparse.Namespace, seconds: dict, tokens: dict) -> None:
    rows = []
    for stage, losses in (("before", before), ("after", after)):
        for tier in TIERS:
            key = f"tier{tier}"
            base = losses["unordered"][key]
            rows.append([stage, str(tier), str(config.intermediate_size >> tier),
                         *(f"{losses[run][key]:.4f}" for run in RUNS),
                         *(f"{losses[run][key] / base:.3f}" for run in RUNS[1:])])
    print()
    print_table(["stage", "tier", "FFN", *RUNS, "weights/unordered", "activations/unordered"],
                rows)
    for score, shares in kept.items():
        print(f"{score} score held by the prefix, unordered -> ordered: " + ", ".join(
            f"{tier} {a:.1%} -> {b:.1%}" for tier, (a, b) in shares.items()))
    print("ratios: ordered / unordered held-out loss (< 1: the ordered slice is better); "
          f"before: after pretraining at tier 0 only ({tokens['pretrain']:,} tokens); after: "
          f"+{tokens['finetune']:,} tokens at tiers 0,1,2 summed")
    print(f"wall: {seconds['total']:,.0f} s")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "smoke")}
        figures = {"settings": {**settings, "model": TINY, "seq_len": SEQ_LEN,
                                "tokens": tokens, "torch": torch.__version__},
                   "before": before, "after": after, "kept": kept, "seconds": seconds}
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
