"""`matformer-train`: a short standalone training of a small nested model on real text.

It trains every requested tier of one set of weights on the Python standard library's
docstrings (present on any machine, no download), prints loss per tier as it goes, then
evaluates each tier on held-out text and writes a Hugging Face style checkpoint (config.json,
model.safetensors) and the metrics to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from modeling import ModelConfig, build_model
from modeling.checkpoint import save_pretrained
from modeling.corpus import python_docs_tokens
from modeling.matformer import tier_label
from modeling.optim import OptimizerConfig
from modeling.tokenizer import ByteTokenizer
from modeling.training import TierSchedule, train_step

# A model that learns visibly in a minute on two CPU cores.
TINY = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=512, max_position_embeddings=512)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="matformer-train", description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, help="model config JSON (default: a tiny model)")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--tiers", default="0,1,2", help="comma-separated tiers to train")
    parser.add_argument("--tier-mode", choices=["all", "sample"], default="all",
                        help="all: every tier each step (summed losses); sample: one per step")
    parser.add_argument("--optimizer", choices=["adam", "adamw", "muon"], default="adamw")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup-steps", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=600_000, help="corpus size in tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("runs/standalone"))
    return parser.parse_args(argv)


def windows(tokens: torch.Tensor, count: int, length: int, generator: torch.Generator
            ) -> torch.Tensor:
    """``count`` random windows of ``length`` tokens: (count, length)."""
    starts = torch.randint(0, len(tokens) - length, (count,), generator=generator)
    return torch.stack([tokens[s:s + length] for s in starts.tolist()])


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[torch.Tensor], tiers: list[int]
             ) -> dict[str, float]:
    model.eval()
    losses = {tier_label(t): sum(model.loss(b, tier=t).item() for b in batches) / len(batches)
              for t in tiers}
    model.train()
    return losses


def main(argv: list[str] | None = None) -> None:
    train(parse_args(argv))


def train(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Run the training ``args`` describe; returns the metrics it also writes."""
    torch.manual_seed(args.seed)
    config = ModelConfig.from_json(args.config) if args.config else ModelConfig(**TINY)
    tiers = [int(t) for t in args.tiers.split(",")]
    schedule = TierSchedule(tiers=tiers, mode=args.tier_mode, seed=args.seed)
    schedule.check(config)
    model = build_model(config)
    optimizer = OptimizerConfig(
        name=args.optimizer, lr=args.lr, final_lr=args.lr / 10, weight_decay=0.01,
        warmup_steps=args.warmup_steps, total_steps=args.steps,
    ).build(model)

    tokens = python_docs_tokens(ByteTokenizer(), max_tokens=args.max_tokens)
    split = int(len(tokens) * 0.95)
    train, held_out = tokens[:split], tokens[split:]
    generator = torch.Generator().manual_seed(args.seed)
    eval_batches = [windows(held_out, args.batch_size, args.seq_len, generator) for _ in range(4)]
    print(f"matformer-train: {sum(p.numel() for p in model.parameters()):,} parameters, "
          f"{len(tokens):,} tokens of Python docs, tiers {tiers} ({args.tier_mode})")

    initial = evaluate(model, eval_batches, tiers)
    history = []
    started, tokens_seen = time.perf_counter(), 0
    for step in range(args.steps):
        batch = windows(train, args.batch_size, args.seq_len, generator)
        losses = train_step(model, optimizer, batch, None, schedule, step, max_grad_norm=1.0)
        tokens_seen += batch.numel() * len(losses)
        history.append({"step": step, "lr": optimizer.lr, "loss": losses})
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            rate = tokens_seen / (time.perf_counter() - started)
            shown = "  ".join(f"tier {t}: {loss:.3f}" for t, loss in losses.items())
            print(f"step {step + 1:>5}  {shown}  lr {optimizer.lr:.2e}  {rate:,.0f} tok/s")
    final = evaluate(model, eval_batches, tiers)
    for tier in initial:
        print(f"held-out loss tier {tier}: {initial[tier]:.3f} -> {final[tier]:.3f}")

    save_pretrained(model, args.out)
    metrics = {"initial": initial, "final": final, "history": history}
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    print(f"wrote {args.out}/config.json, model.safetensors, metrics.json")
    return metrics


if __name__ == "__main__":
    main()
