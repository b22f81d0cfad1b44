"""Training-step throughput of our Llama-shaped model against Hugging Face's LlamaForCausalLM.

Both models get the same shapes, dtype, device, batch and initial weights (ours copied into
HF's through ``canonical_state_dict``), and the same AdamW (``OptimizerConfig.build``). Before
timing, their losses on the batch must agree, so the two time the same computation. The
step is forward + causal LM loss + backward + AdamW update; timings interleave the models
in blocks and report medians. See bench/README.md for how to read the output.

    python bench/train_step_vs_hf.py                 # fp32 on CPU, default shapes
    python bench/train_step_vs_hf.py --dtype bf16 --steps 10
"""

from __future__ import annotations

import argparse
import statistics

import torch
from harness import (
    add_shape_args,
    contention_warning,
    describe,
    mib,
    model_config,
    print_table,
    random_batch,
    setup,
    step_peak_bytes,
    time_interleaved,
    train_step,
)
from transformers import LlamaConfig, LlamaForCausalLM

from modeling import AutoregressiveModel, ModelConfig, canonical_state_dict
from modeling.optim import OptimizerConfig

# Largest |loss difference| at which the two models count as computing the same thing.
LOSS_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def hf_twin(config: ModelConfig) -> LlamaForCausalLM:
    """An HF Llama with our config's shapes, sdpa attention and no KV cache (training)."""
    hf_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_args(parser)
    args = parser.parse_args()
    device, dtype = setup(args)

    config = model_config(args)
    ours = AutoregressiveModel(config)
    hf = hf_twin(config)
    hf.load_state_dict(canonical_state_dict(ours), strict=True)
    ours.to(device, dtype).train()
    hf.to(device, dtype).train()
    ids = random_batch(args, device)

    with torch.no_grad():
        loss_ours = ours.loss(ids).item()
        loss_hf = hf(input_ids=ids, labels=ids).loss.item()
    gap = abs(loss_ours - loss_hf)
    print(describe(args, device))
    print(f"first-batch loss: ours {loss_ours:.6f}  hf {loss_hf:.6f}  |diff| {gap:.2e}")
    if gap > LOSS_TOLERANCE[dtype]:
        raise SystemExit(
            f"losses differ by {gap:.2e} (> {LOSS_TOLERANCE[dtype]:.0e}): the models do not "
            "compute the same function, so their timings are not comparable. Check that the "
            "config maps onto LlamaConfig (rope, norm eps, tied embeddings)."
        )

    optim = OptimizerConfig(name="adamw", lr=args.lr, total_steps=10**6, schedule="constant")
    steps = {
        "ours": train_step(lambda: ours.loss(ids), optim.build(ours)),
        "hf": train_step(lambda: hf(input_ids=ids, labels=ids).loss, optim.build(hf)),
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
    print(
        f"\nthroughput ours/hf: {statistics.median(paired):.3f} "
        f"(per repetition: {', '.join(f'{r:.3f}' for r in paired)}; > 1 means ours is faster)"
    )
    print(f"step peak ours/hf: {peaks['ours'] / peaks['hf']:.3f} (< 1 means ours uses less)")
    warning = contention_warning(timings, device)
    if warning:
        print(f"\n{warning}")


if __name__ == "__main__":
    main()
