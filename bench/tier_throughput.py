"""Training-step throughput and step memory of each MatFormer tier of one universal model.

Tier t trains the first intermediate_size / 2**t FFN neurons of every layer. All tiers run
on the same model, batch and AdamW, interleaved in blocks (see bench/harness.py), and are
reported relative to tier 0. "flops vs t0" is the ratio of matmul FLOPs per token, the
speed-up a tier could reach if time followed FLOPs alone.

Step memory is the peak of tensor memory during one step above the weights and optimizer
state held before it. On CUDA that is ``max_memory_allocated`` after a reset; on CPU the
step runs once under ``torch.profiler`` with ``profile_memory=True`` and the peak of the
running total of its allocation records is reported (bench/harness.py explains why not RSS).
On CUDA the run also reports each tier's model FLOPs utilization (``harness.step_flops`` at
the tier's FFN width, against the GPU's datasheet peak) and the device's peak of allocated
memory over the whole run (weights, AdamW's state and the largest step).

    python bench/tier_throughput.py
    python bench/tier_throughput.py --tiers 0,2 --dtype bf16
    python bench/tier_throughput.py --device cuda --precision bf16 --json runs/tiers.json
    python bench/tier_throughput.py --smoke       # tiny shapes, 2 steps per tier: it runs
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
from harness import (
    SMOKE_SHAPE,
    add_shape_args,
    contention_warning,
    describe,
    mib,
    model_config,
    parse,
    peak_tflops,
    precision_step,
    print_table,
    random_batch,
    setup,
    step_flops,
    step_peak_bytes,
    time_interleaved,
)

from matformer.modeling import AutoregressiveModel, ModelConfig, TierError, tier_width
from matformer.modeling.devices import PRECISIONS, Precision
from matformer.modeling.optim import OptimizerConfig


def matmul_flops_per_token(config: ModelConfig, width: int, seq_len: int) -> int:
    """Forward matmul FLOPs per token with FFN width ``width`` (backward is about twice)."""
    hidden, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    weights = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * width  # q, o; k, v; FFN
    attention = 2 * seq_len * hidden  # q·k and p·v over the ~T/2 keys the causal mask keeps
    per_layer = 2 * weights + attention
    return config.num_hidden_layers * per_layer + 2 * hidden * config.vocab_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(parser)
    parser.add_argument("--tiers", default="0,1,2,3", help="comma-separated tiers to compare")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="autocast precision with float32 weights (fp16 adds a loss scale)")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.set_defaults(steps=8, repeats=4, warmup=1)
    args = parse(parser, SMOKE_SHAPE)
    if args.precision != "fp32" and args.dtype != "fp32":
        parser.error("--precision runs float32 weights under autocast and --dtype casts the "
                     "weights themselves; use one of them.")
    tiers = [int(t) for t in args.tiers.split(",")]
    device, dtype = setup(args)

    config = model_config(args)
    try:
        widths = {tier: tier_width(config, tier) for tier in tiers}
    except TierError as err:
        raise SystemExit(f"--tiers {args.tiers}: {err}") from err
    model = AutoregressiveModel(config).to(device, dtype).train()
    optimizer = OptimizerConfig(
        name="adamw", lr=args.lr, total_steps=10**6, schedule="constant"
    ).build(model)
    ids = random_batch(args, device)
    print(describe(args, device) + f" | precision {args.precision}")

    precision = Precision(args.precision, device)
    parameters = list(model.parameters())
    steps = {
        tier: precision_step(lambda tier=tier: model.loss(ids, tier=tier), optimizer, precision,
                             parameters)
        for tier in tiers
    }
    timings = time_interleaved(
        steps, device, timed=args.steps, repeats=args.repeats, warmup=args.warmup
    )
    peaks = {tier: step_peak_bytes(step, device) for tier, step in steps.items()}

    base = tiers[0]
    tokens = args.batch_size * args.seq_len
    base_flops = matmul_flops_per_token(config, widths[base], args.seq_len)
    rows = []
    for tier, timing in timings.items():
        # Speed-up within each repetition, where the tiers ran back to back.
        paired = [
            b / t
            for b, t in zip(timings[base].block_medians(), timing.block_medians(), strict=True)
        ]
        flops = matmul_flops_per_token(config, widths[tier], args.seq_len)
        rows.append([
            str(tier),
            str(widths[tier]),
            f"{timing.median * 1e3:,.0f}",
            f"{tokens / timing.median:,.0f}",
            f"{statistics.median(paired):.2f}x",
            f"{base_flops / flops:.2f}x",
            mib(peaks[tier]),
            f"{peaks[tier] / peaks[base]:.2f}",
            timing.cpu_use(device),
        ])
    print()
    print_table(
        ["tier", "ffn width", "ms/step", "tokens/s", f"speed vs t{base}", f"flops vs t{base}",
         "step peak (MiB)", f"mem vs t{base}", "cpu use"],
        rows,
    )
    compute = precision.dtype if args.precision != "fp32" else dtype
    mfu = utilization(model, config, widths, timings, device, compute, tokens, args.seq_len)
    if mfu:
        print("\nmodel FLOPs utilization: " + ", ".join(
            f"tier {tier} {value:.1%}" for tier, value in mfu["by_tier"].items())
            + f" of {mfu['device_name']}'s {mfu['peak_tflops']:g} TFLOP/s peak")
    warning = contention_warning(timings, device)
    if warning:
        print(f"\n{warning}")
    if args.json is not None:
        figures = {
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "torch": torch.__version__,
            "tiers": {str(tier): {
                "ffn_width": widths[tier], "ms_per_step": timing.median * 1e3,
                "tokens_per_s": tokens / timing.median, "step_peak_bytes": peaks[tier],
                "mfu": mfu["by_tier"][tier] if mfu else None,
            } for tier, timing in timings.items()},
            "device_peak_bytes": (torch.cuda.max_memory_allocated(device)
                                  if device.type == "cuda" else None),
            "mfu_peak_tflops": mfu["peak_tflops"] if mfu else None,
            "contention_warning": warning,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
        print(f"wrote {args.json}")


def utilization(model: torch.nn.Module, config: ModelConfig, widths: dict[int, int],
                timings: dict, device: torch.device, dtype: torch.dtype, tokens: int,
                seq_len: int) -> dict | None:
    """Each tier's model FLOPs utilization on CUDA (None elsewhere, or for a GPU whose peak
    ``harness.PEAK_TFLOPS`` lacks)."""
    if device.type != "cuda":
        return None
    name, peak = peak_tflops(device, dtype)
    if peak is None:
        print(f"model FLOPs utilization: peak of {name} unknown (add it to PEAK_TFLOPS in "
              "bench/harness.py)")
        return None
    by_tier = {tier: step_flops(model, config, tokens, seq_len, widths[tier])
               / timing.median / (peak * 1e12) for tier, timing in timings.items()}
    return {"device_name": name, "peak_tflops": peak, "by_tier": by_tier}


if __name__ == "__main__":
    main()
