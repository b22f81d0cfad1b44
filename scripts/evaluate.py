"""`matformer-eval`: held-out loss and perplexity of a checkpoint, per tier.

    matformer-eval runs/standalone --tiers 0,1,2
    matformer-eval runs/testnet/checkpoints/round-150 --data runs/python_docs.mdat \
        --mix-n-match 0,0,1,2 --json eval.json

By default it evaluates what ``matformer-train`` held out: the last 5% of the view's shuffle
(sequences that carry a target), so its figures are the training run's held-out loss. A
folder ``matformer-train`` wrote says what it trained on (``matformer_data.json``: container,
strategy, view, sequence length, seed), and each option left out is taken from it; for any
other checkpoint, ``--data`` names the container. ``--split all``
evaluates every sequence of the view instead (a view kept apart for evaluation, say).
Sequences go through in microbatches of ``--max-eval-tokens-per-microbatch`` padded tokens
(and ``--max-examples-per-microbatch`` rows); one that runs out of memory is split in two
and retried, so a budget too large for the device slows evaluation down rather than ending
it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

from matformer.modeling import trust
from matformer.modeling.checkpoint import load_pretrained
from matformer.modeling.commands import command_parser
from matformer.modeling.config import ModelConfig
from matformer.modeling.devices import PRECISIONS, Precision, resolve_device
from matformer.modeling.errors import MatformerError
from matformer.modeling.matformer import Tier
from matformer.modeling.mdat import DEFAULT_STRATEGY, Mdat
from matformer.modeling.mdat.trained_on import RECORD_NAME, TrainedOn
from matformer.modeling.run_order import RunOrder
from matformer.modeling.threads import add_threads_option, use_threads
from matformer.modeling.training import held_out_loss, with_targets

DEFAULT_SEQ_LEN = 256


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser("matformer-eval", __doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder (config.json, weights)")
    parser.add_argument("--tiers", default="0", help="comma-separated tiers")
    parser.add_argument("--mix-n-match", nargs="*", default=[], metavar="T0,T1,...",
                        help="per-layer tier lists, each evaluated too")
    add_data_options(parser)
    parser.add_argument("--json", type=Path, default=None, help="write the figures here too")
    return parser.parse_args(argv)


def add_data_options(parser: argparse.ArgumentParser) -> None:
    """What is evaluated and how: the container, its split, microbatches, device, precision
    (``matformer slice`` takes them too)."""
    parser.add_argument("--data", type=Path, default=None,
                        help=f"MDAT container (default: the one the checkpoint's {RECORD_NAME} "
                             "names)")
    parser.add_argument("--strategy", default=None,
                        help=f"(default: the run's, else {DEFAULT_STRATEGY['strategy_name']})")
    parser.add_argument("--view", default=None,
                        help="view of the container (default: the run's, else all)")
    parser.add_argument("--seq-len", type=int, default=None,
                        help=f"(default: the run's, else {DEFAULT_SEQ_LEN})")
    parser.add_argument("--split", choices=("held-out", "all"), default="held-out",
                        help="held-out: the tail matformer-train left out; all: the whole view")
    parser.add_argument("--seed", type=int, default=None,
                        help="of the shuffle (and of masks; default: the run's, else 0)")
    parser.add_argument("--limit", type=int, default=None, help="evaluate at most N sequences")
    parser.add_argument("--max-eval-tokens-per-microbatch", type=int, default=8192)
    parser.add_argument("--max-examples-per-microbatch", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | mps")
    add_threads_option(parser)
    trust.add_option(parser)
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32")


def with_run_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with what the checkpoint's run trained on wherever an option was left out."""
    record = TrainedOn.read(args.checkpoint)
    if args.data is None and record is None:
        raise MatformerError(f"{args.checkpoint} does not say what it was trained on (no "
                             f"{RECORD_NAME}); name the container with --data MDAT.")
    fallback = {"data": None, "strategy": DEFAULT_STRATEGY["strategy_name"], "view": None,
                "seq_len": DEFAULT_SEQ_LEN, "seed": 0}
    for name, default in fallback.items():
        if getattr(args, name) is None:
            setattr(args, name, getattr(record, name) if record is not None else default)
    args.data = Path(args.data)
    return args


def tiers_of(args: argparse.Namespace) -> list[Tier]:
    try:
        tiers: list[Tier] = [int(t) for t in args.tiers.split(",") if t.strip()]
        tiers += [[int(t) for t in spec.split(",")] for spec in args.mix_n_match]
    except ValueError:
        raise MatformerError(f"--tiers and --mix-n-match take comma-separated integers, got "
                             f"{args.tiers!r} and {args.mix_n_match}.") from None
    return tiers


def evaluate(args: argparse.Namespace) -> dict:
    """The figures ``args`` ask for, as ``--json`` writes them."""
    args = with_run_defaults(args)
    device = resolve_device(args.device)
    model = load_pretrained(args.checkpoint, trust_remote_code=args.trust_remote_code).to(device)
    tiers = tiers_of(args)
    examples = evaluated_examples(args, model.config, device)
    losses = held_out_loss(
        model, examples, tiers, batch_tokens=args.max_eval_tokens_per_microbatch,
        max_examples=args.max_examples_per_microbatch,
        precision=Precision(args.precision, device), seed=args.seed)
    return {
        "checkpoint": str(args.checkpoint), "data": str(args.data), "strategy": args.strategy,
        "view": args.view, "seq_len": args.seq_len, "split": args.split, "seed": args.seed,
        "sequences": len(examples), "tokens": sum(len(e) for e in examples),
        "tiers": {label: {"loss": loss, "perplexity": math.exp(min(loss, 700.0))}
                  for label, loss in losses.items()},
    }


def evaluated_examples(args: argparse.Namespace, config: ModelConfig,
                       device: torch.device) -> list[torch.Tensor]:
    """The sequences ``args`` name (``with_run_defaults``' data, ``--split``, ``--limit``),
    as int64 tensors on ``device``."""
    with Mdat.open(args.data) as mdat:
        if args.split == "held-out":
            reader, order = RunOrder.open(mdat, args.strategy, args.seq_len, args.view,
                                          args.seed, config)
            ids = order.held_out
        else:
            reader = mdat.sequences(args.strategy, args.seq_len, args.view)
            ids = with_targets(np.arange(len(reader)), reader.lengths(), config,
                               reader.response_lengths())
        ids = ids[:args.limit]
        return [torch.from_numpy(reader[int(i)].astype(np.int64)).to(device) for i in ids]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        use_threads(args.threads)
        figures = evaluate(args)
    except MatformerError as error:
        print(f"matformer-eval: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"{figures['checkpoint']}: {figures['sequences']:,} {figures['split']} sequences, "
          f"{figures['tokens']:,} tokens")
    for label, row in figures["tiers"].items():
        print(f"tier {label:<12}  loss {row['loss']:.4f}  perplexity {row['perplexity']:,.2f}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
