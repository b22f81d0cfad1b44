"""Long sequences: forward + backward time and step memory of the ``wersa`` attention kernel
(linear in T) against ``sdpa`` (quadratic in T) on the same q, k, v.

At each length both kernels run in interleaved blocks (bench/harness.py); a step is the
kernel's forward and the gradients of q, k, v (and of WERSA's own tensors). ``speedup`` is
sdpa's time over wersa's, the median of the per-repetition ratios: above 1, wersa is
faster. Step peak is harness's ``step_peak_bytes`` (the CPU profiler's allocation records;
CUDA's ``max_memory_allocated``). With ``--documents N`` each row holds N packed documents,
so sdpa takes a dense (T x T) mask; with one (the default) it runs its unmasked causal kernel.

    python bench/attention_long.py --threads 1
    python bench/attention_long.py --lengths 1024,4096 --bidirectional --json runs/wersa.json
    python bench/attention_long.py --smoke        # 128 and 256 tokens, 2 steps: it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from harness import (
    Step,
    add_device_args,
    contention_warning,
    mib,
    parse,
    print_table,
    setup,
    step_peak_bytes,
    time_interleaved,
)
from torch import nn

from matformer.modeling import registry

SMOKE = dict(lengths="128,256", heads=2, head_dim=16, features=16, chunk=32, steps=2,
             warmup=1, threads=1)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    shape = parser.add_argument_group("attention shape")
    shape.add_argument("--lengths", default="1024,2048,4096,8192,16384",
                       help="comma-separated sequence lengths")
    shape.add_argument("--batch-size", type=int, default=1)
    shape.add_argument("--heads", type=int, default=4)
    shape.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    shape.add_argument("--head-dim", type=int, default=64)
    shape.add_argument("--bidirectional", action="store_true", help="default: causal")
    shape.add_argument("--documents", type=int, default=1,
                       help="packed documents per row, of equal length (segment ids)")
    wersa = parser.add_argument_group("wersa")
    wersa.add_argument("--features", type=int, default=64, help="random features")
    wersa.add_argument("--levels", type=int, default=3, help="Haar levels")
    wersa.add_argument("--chunk", type=int, default=64, help="chunk length")
    run = parser.add_argument_group("run")
    add_device_args(run)
    run.add_argument("--steps", type=int, default=4, help="timed steps per kernel and length")
    run.add_argument("--repeats", type=int, default=2, help="interleaved blocks per length")
    run.add_argument("--warmup", type=int, default=1)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--json", type=Path, default=None, help="write the figures here")
    return parse(parser, SMOKE)


def kernels(args: argparse.Namespace, device: torch.device, dtype: torch.dtype
            ) -> dict[str, nn.Module]:
    wersa = registry.get("attention", "kernel", "wersa")(
        head_dim=args.head_dim, features=args.features, levels=args.levels, chunk=args.chunk)
    sdpa = registry.get("attention", "kernel", "sdpa")()
    return {"sdpa": sdpa.to(device, dtype), "wersa": wersa.to(device, dtype)}


def attention_step(kernel: nn.Module, length: int, args: argparse.Namespace,
                   device: torch.device, dtype: torch.dtype) -> Step:
    """Forward, then the gradients of q, k, v and the kernel's tensors (none kept after)."""
    kv_heads = args.kv_heads or args.heads
    shapes = [(args.batch_size, args.heads, length, args.head_dim)] + \
        [(args.batch_size, kv_heads, length, args.head_dim)] * 2
    q, k, v = (torch.randn(s, device=device, dtype=dtype, requires_grad=True) for s in shapes)
    segments = None
    if args.documents > 1:
        document = torch.arange(length, device=device) * args.documents // length + 1
        segments = document.expand(args.batch_size, length)
    inputs = (q, k, v, *kernel.parameters())

    def step() -> None:
        out = kernel(q, k, v, causal=not args.bidirectional, segment_ids=segments)
        torch.autograd.grad(out, inputs, torch.ones_like(out))

    return step


def main() -> None:
    args = parse_args()
    device, dtype = setup(args)
    lengths = [int(n) for n in args.lengths.split(",")]
    contenders = kernels(args, device, dtype)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"cpu, {torch.get_num_threads()} threads")
    print(f"torch {torch.__version__} | {where} | {args.dtype} | batch {args.batch_size} | "
          f"heads {args.heads}/{args.kv_heads or args.heads} kv x {args.head_dim} | "
          f"{'bidirectional' if args.bidirectional else 'causal'} | {args.documents} "
          f"document(s) per row | wersa: {args.features} features, {args.levels} levels, "
          f"chunks of {args.chunk}")

    rows, figures, all_timings = [], [], {}
    for length in lengths:
        steps = {name: attention_step(kernel, length, args, device, dtype)
                 for name, kernel in contenders.items()}
        timings = time_interleaved(steps, device, timed=args.steps, repeats=args.repeats,
                                   warmup=args.warmup)
        peaks = {name: step_peak_bytes(step, device) for name, step in steps.items()}
        sdpa, wersa = timings["sdpa"], timings["wersa"]
        # Ratio within each repetition, where the two ran back to back.
        paired = [s / w for s, w in zip(sdpa.block_medians(), wersa.block_medians(),
                                        strict=True)]
        speedup = statistics.median(paired)
        figures.append({
            "seq_len": length, "sdpa_s": sdpa.median, "wersa_s": wersa.median,
            "speedup": speedup, "sdpa_peak_mib": peaks["sdpa"] / 2**20,
            "wersa_peak_mib": peaks["wersa"] / 2**20,
        })
        rows.append([
            f"{length:,}", f"{sdpa.median * 1e3:,.1f}", f"{wersa.median * 1e3:,.1f}",
            f"{speedup:.2f}x", ", ".join(f"{r:.2f}" for r in paired),
            mib(peaks["sdpa"]), mib(peaks["wersa"]), f"{peaks['wersa'] / peaks['sdpa']:.2f}",
            f"{min(sdpa.cpu_shares + wersa.cpu_shares):.0%}" if device.type == "cpu" else "-",
        ])
        all_timings.update({f"{name}@{length}": t for name, t in timings.items()})
        print(f"  T={length:,}: sdpa {sdpa.median * 1e3:,.1f} ms, wersa "
              f"{wersa.median * 1e3:,.1f} ms", flush=True)

    print()
    print_table(["seq len", "sdpa ms", "wersa ms", "speedup", "per repetition",
                 "sdpa peak MiB", "wersa peak MiB", "mem wersa/sdpa", "cpu use"], rows)
    faster = [f["seq_len"] for f in figures if f["speedup"] > 1]
    print(f"\nspeedup = sdpa time / wersa time (> 1: wersa is faster); wersa faster at: "
          f"{', '.join(f'{n:,}' for n in faster) or 'none of these lengths'}")
    warning = contention_warning(all_timings, device)
    if warning:
        print(f"\n{warning}")
    if args.json:
        settings = {key: str(value) if isinstance(value, Path) else value
                    for key, value in vars(args).items()}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": settings, "torch": torch.__version__,
                                         "lengths": figures}, indent=2) + "\n")


if __name__ == "__main__":
    main()
