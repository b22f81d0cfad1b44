"""Training-step throughput and step memory of each MatFormer tier of one universal model.

Tier t trains the first intermediate_size / 2**t FFN neurons of every layer. All tiers run
on the same model, batch and AdamW, interleaved in blocks (see bench/harness.py), and are
reported relative to tier 0. "flops vs t0" is the ratio of matmul FLOPs per token, the
speed-up a tier could reach if time followed FLOPs alone.

Step memory is the peak of tensor memory during one step above the weights and optimizer
state held before it. On CUDA that is ``max_memory_allocated`` after a reset; on CPU the
step runs once under ``torch.profiler`` with ``profile_memory=True`` and the peak of the
running total of its allocation records is reported (bench/harness.py explains why not RSS).

    python bench/tier_throughput.py
    python bench/tier_throughput.py --tiers 0,2 --dtype bf16
    python bench/tier_throughput.py --smoke       # tiny shapes, 2 steps per tier: it runs
"""

from __future__ import annotations

import argparse
import statistics

from harness import (
    SMOKE_SHAPE,
    add_shape_args,
    contention_warning,
    describe,
    mib,
    model_config,
    parse,
    print_table,
    random_batch,
    setup,
    step_peak_bytes,
    time_interleaved,
    train_step,
)

from matformer.modeling import AutoregressiveModel, ModelConfig, TierError, tier_width
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
    parser.set_defaults(steps=8, repeats=4, warmup=1)
    args = parse(parser, SMOKE_SHAPE)
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
    print(describe(args, device))

    steps = {
        tier: train_step(lambda tier=tier: model.loss(ids, tier=tier), optimizer) for tier in tiers
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
    warning = contention_warning(timings, device)
    if warning:
        print(f"\n{warning}")


if __name__ == "__main__":
    main()
