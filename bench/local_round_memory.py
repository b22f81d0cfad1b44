"""What local steps cost a client in memory and time at the 150M shape.

A client round without local steps holds the model, its gradient and the error feedback's
momentum. With local steps it also holds the inner optimizer's state (AdamW: two moments per
parameter), a copy of the weights from before the round, and the pseudo-gradient in the
feedback's dtype. This benchmark measures that: for each mode, a fresh process builds the
model at the shape (default ``scale.py``'s 150m: hidden 768, 12 layers, FFN 3072, vocab
32000, 162M parameters), wraps it in a ``Replica`` and runs ``--rounds`` rounds of
``client.local_round.LocalRound`` on ``--sequences`` random sequences of ``--seq-len`` tokens
at tier 0, compressing with the run defaults (DCT, chunk 64, top 32, bfloat16):

  gradient  one gradient per round (``[inner]`` off)
  local     local steps of ``--batch-tokens`` tokens each, AdamW

and reports the process's resident memory once the model is built (``model MiB``), its peak
over the rounds (``peak MiB``), the peak above the model (``round MiB``) and seconds per
round. The reference is the gradient mode measured in the same run.

    python bench/local_round_memory.py                        # 150M shape (about 3 min)
    python bench/local_round_memory.py --shape tiny --json runs/local_memory.json
    python bench/local_round_memory.py --smoke                # tiny shape, one round: it runs
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import time
from pathlib import Path

import torch
from harness import parse, print_table

SHAPES = {
    "150m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=12, intermediate_size=3072, vocab_size=32000),
    "tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=512, vocab_size=260),
}
MODES = ("gradient", "local")
SMOKE = dict(shape="tiny", seq_len=64, sequences=2, batch_tokens=64, rounds=1, threads=1)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="150m")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--sequences", type=int, default=4, help="sequences per round")
    parser.add_argument("--batch-tokens", type=int, default=256,
                        help="tokens per inner step (local mode)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None,
                        help="write per mode: model_mib, peak_mib, round_mib, seconds_per_round")
    return parse(parser, SMOKE)


def rss_mib() -> float:
    """This process's resident memory now (Linux /proc)."""
    with open("/proc/self/statm") as statm:
        pages = int(statm.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def measure(mode: str, args: argparse.Namespace, out: multiprocessing.Queue) -> None:
    """One mode in this (fresh) process: figures put on ``out``."""
    from matformer.client.local_round import LocalRound, LocalSteps
    from matformer.client.replica import Replica
    from matformer.modeling import ModelConfig, build_model
    from matformer.modeling.batching import AdaptiveLimitsConfig
    from matformer.modeling.compression import CompressionConfig
    from matformer.modeling.optim import OptimizerConfig
    from matformer.modeling.training import TierSchedule

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = ModelConfig(**SHAPES[args.shape], max_position_embeddings=max(512, args.seq_len))
    model = build_model(config)
    parameters = sum(p.numel() for p in model.parameters())
    steps = None
    if mode == "local":
        steps = LocalSteps(optimizer=OptimizerConfig(name="adamw", lr=1e-4, schedule="constant"),
                           batch_tokens=args.batch_tokens)
    limits = AdaptiveLimitsConfig(max_tokens=args.batch_tokens).build()
    work = LocalRound(Replica(model), CompressionConfig().build(), TierSchedule(tiers=[0]),
                      limits, steps=steps)
    model_mib = rss_mib()
    generator = torch.Generator().manual_seed(1)
    seconds = []
    for r in range(args.rounds):
        sequences = [torch.randint(3, config.vocab_size, (args.seq_len,), generator=generator)
                     for _ in range(args.sequences)]
        start = time.perf_counter()
        work.run(sequences, step=r)
        seconds.append(time.perf_counter() - start)
    out.put({"mode": mode, "parameters": parameters, "model_mib": model_mib,
             "peak_mib": peak_rss_mib(), "round_mib": peak_rss_mib() - model_mib,
             "seconds_per_round": min(seconds)})


def main() -> None:
    args = parse_args()
    context = multiprocessing.get_context("spawn")  # each mode's peak from a fresh process
    rows = {}
    for mode in MODES:
        out = context.Queue()
        process = context.Process(target=measure, args=(mode, args, out))
        process.start()
        rows[mode] = out.get()
        process.join()
    parameters = rows["gradient"]["parameters"]
    print(f"torch {torch.__version__} | cpu, {args.threads} threads | shape {args.shape}: "
          f"{parameters:,} parameters | tier 0 | {args.rounds} rounds of {args.sequences} x "
          f"{args.seq_len} tokens | local: AdamW steps of {args.batch_tokens} tokens | DCT "
          "chunk 64, top 32, bfloat16")
    print_table(
        ["mode", "model MiB", "peak MiB", "round MiB", "s/round"],
        [[m, f"{r['model_mib']:,.0f}", f"{r['peak_mib']:,.0f}", f"{r['round_mib']:,.0f}",
          f"{r['seconds_per_round']:.2f}"] for m, r in rows.items()],
    )
    weights_mib = parameters * 4 / 2**20
    extra = rows["local"]["round_mib"] - rows["gradient"]["round_mib"]
    print(f"local steps add {extra:,.0f} MiB over a gradient round ({extra / weights_mib:.1f}x "
          f"the float32 weights, {weights_mib:,.0f} MiB); peak local / gradient: "
          f"{rows['local']['peak_mib'] / rows['gradient']['peak_mib']:.2f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
