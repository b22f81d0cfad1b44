"""Data parallelism on CPU: 2 Gloo processes against 1 process on the same global batch.

The bench starts ``torchrun --standalone`` with 1 process, with 2 processes that each hold
the model, and with 2 that share it in shards (``--fsdp``, FSDP2). All train the same model
from the same weights on the same global batches of packed rows (``tier_gradients`` with
``DataParallel``, then AdamW). The cores are shared fairly: the single process gets every
core as torch threads, each of two gets half. Per run: real tokens per second over the
timed steps, the loss after them (the runs must agree: they compute the same steps), and
each process's peak resident memory (``ru_maxrss``: weights, optimizer state, activations,
and torch's own footprint).

    python bench/data_parallel.py
    python bench/data_parallel.py --hidden-size 512 --layers 8 --json runs/dp.json
    python bench/data_parallel.py --smoke         # 2 FSDP2 ranks, 2 steps: it runs
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from harness import parse

from matformer.modeling import ModelConfig, build_model
from matformer.modeling.batching import AdaptiveLimitsConfig, MicrobatchRunner, plan_packed
from matformer.modeling.distributed import DataParallel
from matformer.modeling.optim import OptimizerConfig
from matformer.modeling.training import StepOptions, TierSchedule, train_step_on_examples

SMOKE = dict(hidden_size=32, layers=1, heads=2, vocab_size=512, seq_len=64, batch_tokens=256,
             microbatch_tokens=128, steps=2, warmup=1, runs="2fsdp")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=256, help="row length")
    parser.add_argument("--batch-tokens", type=int, default=4096, help="global batch")
    parser.add_argument("--microbatch-tokens", type=int, default=1024)
    parser.add_argument("--tiers", default="0,1", help="tiers trained each step")
    parser.add_argument("--steps", type=int, default=8, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--runs", default="1,2,2fsdp",
                        help="process counts to compare; 'fsdp' after one shards the model")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--fsdp", action="store_true", help=argparse.SUPPRESS)
    return parse(parser, SMOKE, argv)


def worker(args: argparse.Namespace) -> None:
    """One rank's run under torchrun; rank 0 writes the run's figures to ``--worker``."""
    parallel = DataParallel.from_environment(torch.device("cpu"), sharded=args.fsdp)
    world = parallel.world_size if parallel else 1
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.heads, intermediate_size=4 * args.hidden_size,
                         max_position_embeddings=args.seq_len)
    model = build_model(config)
    if args.fsdp:
        parallel.shard(model)
    optimizer = OptimizerConfig(name="adamw", lr=1e-3, schedule="constant",
                                total_steps=10**6).build(model)
    runner = MicrobatchRunner(model, AdaptiveLimitsConfig(
        max_tokens=args.microbatch_tokens).build())
    options = StepOptions(data_parallel=parallel)
    schedule = TierSchedule(tiers=[int(t) for t in args.tiers.split(",")])
    draw = torch.Generator().manual_seed(1)
    lengths = torch.exp(torch.empty(4000).uniform_(
        2.8, float(torch.log(torch.tensor(args.seq_len))), generator=draw)).long().tolist()
    corpus = [torch.randint(0, args.vocab_size, (n,), generator=draw) for n in lengths]
    plan = plan_packed(lengths, args.batch_tokens, args.seq_len)
    tokens, losses, started = 0, {}, 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            started = time.perf_counter()
        rows = plan[step % len(plan)]
        batch = [i for row in rows for i in row]
        position = {index: n for n, index in enumerate(batch)}
        losses = train_step_on_examples(
            runner, optimizer, [corpus[i] for i in batch], schedule, step,
            rows=[[position[i] for i in row] for row in rows], options=options)
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            tokens += sum(lengths[i] for i in batch)
    seconds = time.perf_counter() - started
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024],
                        dtype=torch.float64)
    peaks = [float(peak)] if parallel is None else _gathered(parallel, peak)
    if parallel is None or parallel.leader:
        args.worker.write_text(json.dumps({
            "ranks": world, "fsdp": args.fsdp, "threads_per_rank": torch.get_num_threads(),
            "parameters": sum(p.numel() for p in model.parameters()),
            "tokens_per_s": tokens / seconds, "seconds": seconds, "final_loss": losses,
            "peak_rss_bytes_per_rank": peaks}))
    if parallel is not None:
        parallel.close()


def _gathered(parallel: DataParallel, value: torch.Tensor) -> list[float]:
    values = [torch.zeros_like(value) for _ in range(parallel.world_size)]
    torch.distributed.all_gather(values, value)
    return [float(v) for v in values]


def launch(run: str, argv: list[str]) -> dict:
    ranks = int(run.removesuffix("fsdp"))
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "figures.json"
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             f"--nproc-per-node={ranks}", __file__, *argv, "--worker", str(out),
             *(["--fsdp"] if run.endswith("fsdp") else [])],
            check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return json.loads(out.read_text())


def main() -> None:
    args = parse_args()
    if args.worker is not None:
        return worker(args)
    argv = list(sys.argv[1:])
    if "--json" in argv:
        at = argv.index("--json")
        del argv[at:at + 2]
    runs = {run: launch(run, argv) for run in args.runs.split(",")}
    base = runs[args.runs.split(",")[0]]
    print(f"model: {base['parameters']:,} parameters; global batch {args.batch_tokens:,} "
          f"tokens of packed rows of {args.seq_len}; tiers {args.tiers}; {args.steps} timed "
          f"steps; {os.cpu_count()} cores")
    print(f"{'run':>6}  {'threads/rank':>12}  {'tokens/s':>9}  {'vs 1 rank':>9}  "
          f"{'peak RSS per rank (MiB)':>24}  final loss")
    for name, run in runs.items():
        peaks = ", ".join(f"{p / 2**20:,.0f}" for p in run["peak_rss_bytes_per_rank"])
        losses = " ".join(f"{v:.4f}" for v in run["final_loss"].values())
        print(f"{name:>6}  {run['threads_per_rank']:>12}  {run['tokens_per_s']:>9,.0f}  "
              f"{run['tokens_per_s'] / base['tokens_per_s']:>8.2f}x  {peaks:>24}  {losses}")
    if args.json:
        args.json.write_text(json.dumps(
            {"runs": runs, "tokens_per_s_ratio": {
                name: r["tokens_per_s"] / base["tokens_per_s"] for name, r in runs.items()}},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
