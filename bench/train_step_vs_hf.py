"""Training-step throughput of our Llama-shaped model against Hugging Face's LlamaForCausalLM.

Both models get the same shapes, dtype, device, batch and initial weights (ours copied into
HF's through ``canonical_state_dict``), and the same AdamW (``OptimizerConfig.build``). Before
timing, their losses on the batch must agree, so the two time the same computation. The
step is forward + causal LM loss + backward + AdamW update; timings interleave the models
in blocks and report medians. See bench/README.md for how to read the output.

Both run under the same settings: ``--dtype`` casts the weights themselves (pure bf16);
``--precision`` keeps float32 weights and runs both forwards under the same autocast
(``modeling.devices.Precision``; fp16 with a loss scale, one per model, starting equal);
``--compile`` compiles ours with ``modeling.devices.compile_model`` and HF's with the same
``Module.compile(dynamic=True)``. On CUDA the run reports model FLOPs utilization.

    python bench/train_step_vs_hf.py                 # fp32 on CPU, default shapes
    python bench/train_step_vs_hf.py --dtype bf16 --steps 10
    python bench/train_step_vs_hf.py --precision bf16 --compile --json runs/step.json
    python bench/train_step_vs_hf.py --device cuda --precision bf16 --batch-size 16
    python bench/train_step_vs_hf.py --smoke          # tiny shapes, 2 steps: it runs
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from harness import (
    SMOKE_SHAPE,
    Timing,
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
from torch import Tensor, nn
from transformers import LlamaConfig, LlamaForCausalLM

from matformer.modeling import (
    AutoregressiveModel,
    ModelConfig,
    TierError,
    canonical_state_dict,
    layer_widths,
    tier_width,
)
from matformer.modeling.checkpoint.slicing import slice_state
from matformer.modeling.devices import PRECISIONS, Precision, compile_model, resolve_device
from matformer.modeling.errors import DeviceUnavailable
from matformer.modeling.optim import OptimizerConfig

# Largest |loss difference| at which the two models count as computing the same thing, by
# the dtype the matmuls run in (the weights' under --dtype, autocast's under --precision).
LOSS_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


def hf_twin(config: ModelConfig, tier: int = 0) -> LlamaForCausalLM:
    """An HF Llama with our config's shapes at ``tier`` (a dense model of that FFN width), sdpa
    attention and no KV cache (training)."""
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=tier_width(config, tier),
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        tie_word_embeddings=config.tie_word_embeddings,
        use_cache=False,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(hf_config)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(parser)
    both = parser.add_argument_group("settings both models share")
    both.add_argument("--precision", choices=PRECISIONS, default="fp32",
                      help="autocast precision with float32 weights (fp16 adds a loss scale)")
    both.add_argument("--compile", action="store_true",
                      help="torch.compile both models (Module.compile(dynamic=True))")
    both.add_argument("--tier", type=int, default=0,
                      help="ours trains this MatFormer tier of the universal model; HF's twin "
                           "is the dense Llama of that FFN width, holding the tier's slice")
    both.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parse(parser, SMOKE_SHAPE)
    if args.precision != "fp32" and args.dtype != "fp32":
        parser.error("--precision runs float32 weights under autocast and --dtype casts the "
                     "weights themselves; use one of them.")
    return args


def check_compiler(device: torch.device) -> None:
    """Stop before compiling when inductor cannot build CPU kernels: it writes C++."""
    if device.type == "cpu" and not (os.environ.get("CXX") or shutil.which("g++")
                                     or shutil.which("clang++")):
        raise SystemExit("--compile on CPU needs a C++ compiler (g++, clang++ or $CXX) and "
                         "none is on PATH: install one (apt-get install g++) or drop --compile.")


def first_losses(
    losses: dict[str, Callable[[], Tensor]], models: dict[str, nn.Module],
    precision: Precision, compiled: bool,
) -> dict[str, float]:
    """Each model's loss on the batch under the run's settings. A compiled model also runs
    backward once (gradients then dropped), so that compiling its forward and backward
    graphs happens here, where a compiler failure is reported as such."""
    values = {}
    for name, loss in losses.items():
        try:
            if not compiled:
                with torch.no_grad(), precision.autocast():
                    values[name] = loss().item()
                continue
            with precision.autocast():
                value = loss()
            value.backward()
            models[name].zero_grad(set_to_none=True)
            values[name] = value.item()
        except Exception as error:
            if not compiled:
                raise
            print(f"torch.compile failed for {name} on this machine (torch {torch.__version__}"
                  f"): {type(error).__name__}: {str(error).strip().splitlines()[0]}",
                  file=sys.stderr)
            raise SystemExit("no compiled figures: rerun without --compile, or fix the "
                             "compiler error above (TORCHDYNAMO_VERBOSE=1 shows the "
                             "traceback).") from None
    return values


def utilization(
    flops: float, timings: dict[str, Timing], device: torch.device, dtype: torch.dtype
) -> tuple[str, dict[str, float] | None]:
    """A line on model FLOPs utilization and its value per model (None when not taken)."""
    if device.type != "cuda":
        return (f"model FLOPs utilization: skipped ({device.type} run; it is reported on "
                "CUDA only, against the GPU's datasheet peak)."), None
    name, peak = peak_tflops(device, dtype)
    if peak is None:
        return (f"model FLOPs utilization: peak of {name} unknown (add it to PEAK_TFLOPS in "
                f"bench/harness.py); {flops / 1e12:.3f} TFLOP per step."), None
    mfu = {model: flops / timing.median / (peak * 1e12) for model, timing in timings.items()}
    return (f"model FLOPs utilization: ours {mfu['ours']:.1%}, hf {mfu['hf']:.1%} of {name}'s "
            f"{peak:g} TFLOP/s {'fp32' if dtype == torch.float32 else 'bf16/fp16'} peak "
            f"({flops / 1e12:.3f} TFLOP per step: 6·N·tokens + 12·L·H·D·T·tokens)"), mfu


def main() -> None:
    args = parse_args()
    try:
        device = resolve_device(args.device)
    except DeviceUnavailable as error:
        raise SystemExit(str(error)) from None
    args.device = str(device)
    _, dtype = setup(args)
    # One Precision per model: under fp16 each keeps its own loss scale, both starting equal.
    precisions = {name: Precision(args.precision, device) for name in ("ours", "hf")}
    compute_dtype = precisions["ours"].dtype if args.precision != "fp32" else dtype

    config = model_config(args)
    ours = AutoregressiveModel(config)
    try:
        hf = hf_twin(config, args.tier)
    except TierError as error:
        raise SystemExit(f"--tier {args.tier}: {error}") from None
    hf.load_state_dict(slice_state(canonical_state_dict(ours), layer_widths(config, args.tier)),
                       strict=True)
    ours.to(device, dtype).train()
    hf.to(device, dtype).train()
    if args.compile:
        check_compiler(device)
        compile_model(ours)
        hf.compile(dynamic=True)  # what compile_model does, on HF's module
    ids = random_batch(args, device)
    models = {"ours": ours, "hf": hf}
    losses = {
        "ours": lambda: ours.loss(ids, tier=args.tier),
        "hf": lambda: hf(input_ids=ids, labels=ids).loss,
    }

    print(describe(args, device))
    print(f"tier {args.tier} (ffn {tier_width(config, args.tier)}) | precision "
          f"{args.precision} (weights {args.dtype}) | {'compiled' if args.compile else 'eager'}")
    first = first_losses(losses, models, precisions["ours"], args.compile)
    gap = abs(first["ours"] - first["hf"])
    tolerance = LOSS_TOLERANCE[compute_dtype]
    print(f"first-batch loss: ours {first['ours']:.6f}  hf {first['hf']:.6f}  |diff| {gap:.2e}"
          f" (tolerance {tolerance:.0e})")
    if gap > tolerance:
        raise SystemExit(
            f"losses differ by {gap:.2e} (> {tolerance:.0e}): the models do not "
            "compute the same function, so their timings are not comparable. Check that the "
            "config maps onto LlamaConfig (rope, norm eps, tied embeddings)."
        )

    optim = OptimizerConfig(name="adamw", lr=args.lr, total_steps=10**6, schedule="constant")
    steps = {
        name: precision_step(losses[name], optim.build(model), precisions[name],
                             list(model.parameters()))
        for name, model in models.items()
    }
    timings = time_interleaved(
        steps, device, timed=args.steps, repeats=args.repeats, warmup=args.warmup
    )
    peaks = {name: step_peak_bytes(step, device) for name, step in steps.items()}

    tokens = args.batch_size * args.seq_len
    rows = [
        [
            name,
            f"{timing.median * 1e3:,.0f}",
            f"{tokens / timing.median:,.0f}",
            f"{min(timing.block_medians()) * 1e3:,.0f}-{max(timing.block_medians()) * 1e3:,.0f}",
            mib(peaks[name]),
            timing.cpu_use(device),
        ]
        for name, timing in timings.items()
    ]
    print()
    print_table(
        ["model", "ms/step", "tokens/s", "block medians (ms)", "step peak (MiB)", "cpu use"], rows
    )
    # Ratio within each repetition: both blocks ran back to back, so drift cancels.
    paired = [
        hf_block / ours_block
        for ours_block, hf_block in zip(
            timings["ours"].block_medians(), timings["hf"].block_medians(), strict=True
        )
    ]
    ratio = statistics.median(paired)
    print(
        f"\nthroughput ours/hf: {ratio:.3f} "
        f"(per repetition: {', '.join(f'{r:.3f}' for r in paired)}; > 1 means ours is faster)"
    )
    print(f"step peak ours/hf: {peaks['ours'] / peaks['hf']:.3f} (< 1 means ours uses less)")
    flops = step_flops(hf, config, tokens, args.seq_len)  # the tier's dense twin: its Linears
    line, mfu = utilization(flops, timings, device, compute_dtype)
    print(line)
    if args.precision == "fp16":
        # A scale that fell means some steps overflowed and were computed again.
        print(f"fp16 loss scale after the run: ours {precisions['ours'].scale:g}, "
              f"hf {precisions['hf'].scale:g} (both started at {Precision('fp16').scale:g})")
    warning = contention_warning(timings, device)
    if warning:
        print(f"\n{warning}")
    if args.json is not None:
        figures = {
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                            else f"{device.type}, {torch.get_num_threads()} threads"),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "first_loss": first,
            "models": {
                name: {
                    "ms_per_step": timing.median * 1e3,
                    "tokens_per_s": tokens / timing.median,
                    "block_medians_ms": [t * 1e3 for t in timing.block_medians()],
                    "step_peak_bytes": peaks[name],
                    "min_cpu_share": min(timing.cpu_shares) if device.type == "cpu" else None,
                    "mfu": None if mfu is None else mfu[name],
                    "final_loss_scale": precisions[name].scale,
                }
                for name, timing in timings.items()
            },
            "throughput_ours_over_hf": ratio,
            "per_repetition": paired,
            "step_peak_ours_over_hf": peaks["ours"] / peaks["hf"],
            "flops_per_step": flops,
            "contention_warning": warning,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
