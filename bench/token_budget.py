"""Packed against padded token-budget batches, and both against fixed-size batches.

Two parts. **Planning** (no model): on ``--plan-count`` lengths drawn log-uniform in
[``--plan-min``, ``--plan-max``] (default 5,000 in [16, 2048]) with a budget of
``--plan-budget`` tokens (16,384), the padding each planner leaves: ``plan_batches`` in data
order (``sort_window=0``), ``plan_batches`` with its default window, and ``plan_packed``
(rows of ``--plan-max`` tokens). Nothing is dropped or truncated by any of them; the bench
checks that every sequence lands in exactly one batch.

**Training** (a tiny model, one epoch each, same initial weights and AdamW): the corpus is
``--docs`` sequences, by default with lengths drawn as above (token ids random: the cost
does not depend on them) or, with ``--corpus docstrings``, the standard library's
docstrings as bytes. The contenders process the same real tokens:

- ``fixed``: ``--batch-size`` sequences per step in data order, each batch padded to its
  own longest (dynamic padding, as Hugging Face's DataCollatorWithPadding does).
- ``padded``: ``plan_batches`` with a budget of batch size x max length padded tokens, the
  most a fixed batch can hold, sorted by length within runs of ``--sort-window`` batches.
- ``packed``: ``plan_packed`` with the same budget, rows of max length tokens.

Each batch is cut by ``split_microbatches`` (``--microbatch-tokens``, default the budget)
and runs ``accumulate_gradients`` and an optimizer step. Padding waste is padded minus real
tokens over padded tokens fed to the model. Epochs run interleaved (see bench/harness.py);
throughput ratios are medians of per-repetition ratios.

    python bench/token_budget.py
    python bench/token_budget.py --corpus docstrings --docs 1500 --max-len 512
    python bench/token_budget.py --smoke          # 40 sequences, a 30k-parameter model: it runs
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from harness import (
    Step,
    add_device_args,
    contention_warning,
    parse,
    print_table,
    setup,
    time_interleaved,
)
from torch import Tensor

from matformer.modeling import AutoregressiveModel, ModelConfig
from matformer.modeling.batching import (
    accumulate_gradients,
    padded_tokens,
    plan_batches,
    plan_packed,
    split_microbatches,
)
from matformer.modeling.corpus import python_docs
from matformer.modeling.optim import OptimizerConfig
from matformer.modeling.tokenizers import ByteTokenizer

SMOKE = dict(plan_count=200, plan_max=256, plan_budget=1024, docs=40, max_len=128,
             hidden_size=32, layers=1, intermediate_size=64, repeats=2, warmup=1, threads=1)


@dataclass(frozen=True, slots=True)
class PlannedStep:
    batch: list[int]  # corpus indices of the step's sequences
    rows: list[list[int]] | None  # packed: positions in ``batch`` per row; None: one a row
    microbatches: list[list[int]]  # positions in the rows (or in ``batch``) per pass


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    planning = parser.add_argument_group("planning (no model)")
    planning.add_argument("--plan-count", type=int, default=5000)
    planning.add_argument("--plan-min", type=int, default=16)
    planning.add_argument("--plan-max", type=int, default=2048)
    planning.add_argument("--plan-budget", type=int, default=16_384)
    data = parser.add_argument_group("training corpus and batching")
    data.add_argument("--corpus", choices=("log-uniform", "docstrings"), default="log-uniform")
    data.add_argument("--docs", type=int, default=600, help="sequences in the corpus")
    data.add_argument("--min-len", type=int, default=16, help="shortest sequence")
    data.add_argument("--max-len", type=int, default=1024, help="longest sequence (row length)")
    data.add_argument("--batch-size", type=int, default=4,
                      help="sequences per fixed batch; budget = batch size x max length")
    data.add_argument("--sort-window", type=int, default=16,
                      help="batches' worth of tokens planned together")
    data.add_argument("--microbatch-tokens", type=int, default=None,
                      help="padded tokens per forward/backward (default: the whole budget)")
    model = parser.add_argument_group("model")
    model.add_argument("--hidden-size", type=int, default=64)
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--kv-heads", type=int, default=2)
    model.add_argument("--intermediate-size", type=int, default=256)
    run = parser.add_argument_group("run")
    add_device_args(run)
    run.add_argument("--repeats", type=int, default=3, help="timed epochs per contender")
    run.add_argument("--warmup", type=int, default=4, help="untimed steps per contender first")
    run.add_argument("--lr", type=float, default=1e-4)
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--json", type=Path, default=None, help="write the figures here")
    return parse(parser, SMOKE)


def log_uniform(count: int, low: int, high: int, seed: int) -> list[int]:
    draw = np.random.default_rng(seed)
    return np.exp(draw.uniform(np.log(low), np.log(high), count)).astype(int).tolist()


def planning(args: argparse.Namespace) -> dict[str, float]:
    """Padding waste of each planner on the planning lengths (fractions of padded tokens)."""
    lengths = log_uniform(args.plan_count, args.plan_min, args.plan_max, args.seed)
    budget, real = args.plan_budget, sum(lengths)
    waste = {}
    for name, window in (("padded, data order", 0), ("padded, window 16", 16)):
        batches = plan_batches(lengths, budget, sort_window=window)
        check_cover(batches, len(lengths))
        waste[name] = 1 - real / sum(padded_tokens([lengths[i] for i in b]) for b in batches)
    packed = plan_packed(lengths, budget, args.plan_max)
    check_cover([[i for row in rows for i in row] for rows in packed], len(lengths))
    waste["packed"] = 1 - real / sum(len(rows) * args.plan_max for rows in packed)
    return waste


def check_cover(batches: list[list[int]], count: int) -> None:
    if sorted(i for batch in batches for i in batch) != list(range(count)):
        raise SystemExit("a planner dropped or repeated a sequence")


def corpus(args: argparse.Namespace, device: torch.device) -> list[Tensor]:
    if args.corpus == "docstrings":
        tokenizer = ByteTokenizer()
        return [torch.tensor(tokenizer.encode(doc, add_eos=True)[: args.max_len], device=device)
                for doc in python_docs(limit=args.docs, min_chars=args.min_len)]
    draw = torch.Generator().manual_seed(args.seed)
    return [torch.randint(3, 256, (n,), generator=draw).to(device)
            for n in log_uniform(args.docs, args.min_len, args.max_len, args.seed + 1)]


def plans(args: argparse.Namespace, lengths: list[int]) -> dict[str, list[PlannedStep]]:
    budget = args.batch_size * args.max_len
    microbatch_tokens = args.microbatch_tokens or budget

    def split(sizes: list[int]) -> list[list[int]]:
        return split_microbatches(sizes, max_tokens=microbatch_tokens, max_examples=len(sizes))

    fixed = [list(range(start, min(start + args.batch_size, len(lengths))))
             for start in range(0, len(lengths), args.batch_size)]
    padded = plan_batches(lengths, budget, sort_window=args.sort_window)
    packed = []
    for rows in plan_packed(lengths, budget, args.max_len, sort_window=args.sort_window):
        batch = [i for row in rows for i in row]
        position = {index: n for n, index in enumerate(batch)}
        local = [[position[i] for i in row] for row in rows]
        packed.append(PlannedStep(batch, local, split([sum(lengths[i] for i in row)
                                                      for row in rows])))
    return {
        "fixed": [PlannedStep(b, None, [list(range(len(b)))]) for b in fixed],
        "padded": [PlannedStep(b, None, split([lengths[i] for i in b])) for b in padded],
        "packed": packed,
    }


def epoch(model: AutoregressiveModel, args: argparse.Namespace, examples: list[Tensor],
          plan: list[PlannedStep], steps: int | None = None) -> Step:
    """One pass over ``plan`` (its first ``steps`` steps, if given)."""
    optimizer = OptimizerConfig(
        name="adamw", lr=args.lr, total_steps=10**6, schedule="constant"
    ).build(model)
    pad = ByteTokenizer.pad_token_id

    def run() -> None:
        for planned in plan[:steps]:
            accumulate_gradients(model, [examples[i] for i in planned.batch],
                                 planned.microbatches, rows=planned.rows, pad_value=pad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return run


def fed_tokens(plan: list[PlannedStep], lengths: list[int]) -> int:
    """Padded tokens the model sees over ``plan``: each pass pads to its longest row."""
    total = 0
    for planned in plan:
        rows = planned.rows or [[i] for i in range(len(planned.batch))]
        sizes = [sum(lengths[planned.batch[i]] for i in row) for row in rows]
        total += sum(padded_tokens([sizes[r] for r in mb]) for mb in planned.microbatches)
    return total


def main() -> None:
    args = parse_args()
    device, dtype = setup(args)
    waste = planning(args)
    print(f"planning: {args.plan_count:,} lengths log-uniform in [{args.plan_min}, "
          f"{args.plan_max}], budget {args.plan_budget:,} tokens")
    print_table(["planner", "padding waste"], [[n, f"{w:.2%}"] for n, w in waste.items()])

    examples = corpus(args, device)
    lengths = [len(example) for example in examples]
    config = ModelConfig(
        vocab_size=ByteTokenizer.vocab_size,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_len,
        pad_token_id=ByteTokenizer.pad_token_id,
        bos_token_id=ByteTokenizer.bos_token_id,
        eos_token_id=ByteTokenizer.eos_token_id,
        mask_token_id=None,
    )
    first = AutoregressiveModel(config).to(device, dtype).train()
    schedules = plans(args, lengths)
    models = {name: copy.deepcopy(first) for name in schedules}
    for name, model in models.items():
        epoch(model, args, examples, schedules[name], steps=args.warmup)()
    epochs = {
        name: epoch(model, args, examples, schedules[name]) for name, model in models.items()
    }
    print(
        f"\ntraining corpus: {len(lengths)} {args.corpus} sequences, {sum(lengths):,} tokens, "
        f"lengths {min(lengths)}-{max(lengths)}, median {statistics.median(lengths):.0f} | "
        f"budget {args.batch_size * args.max_len} padded tokens, sort window "
        f"{args.sort_window} | model hidden {args.hidden_size}, {args.layers} layers, "
        f"{args.dtype}, {device}, {torch.get_num_threads()} threads"
    )
    timings = time_interleaved(
        epochs, device, timed=args.repeats, repeats=args.repeats, warmup=0
    )
    real = sum(lengths)
    rows, figures = [], {"planning_waste": waste, "training": {}}
    for name, timing in timings.items():
        plan, fed = schedules[name], fed_tokens(schedules[name], lengths)
        rows.append([
            name,
            f"{len(plan):,}",
            f"{len(lengths) / len(plan):.1f}",
            f"{sum(len(p.microbatches) for p in plan) / len(plan):.2f}",
            f"{fed:,}",
            f"{1 - real / fed:.1%}",
            f"{timing.median:.2f}",
            f"{real / timing.median:,.0f}",
            timing.cpu_use(device),
        ])
        figures["training"][name] = {"steps": len(plan), "waste": 1 - real / fed,
                                     "real_tokens_per_s": real / timing.median}
    print()
    print_table(
        ["batching", "steps", "seqs/step", "passes/step", "padded tokens", "waste",
         "s/epoch", "real tokens/s", "cpu use"],
        rows,
    )
    for faster, slower in (("packed", "padded"), ("packed", "fixed"), ("padded", "fixed")):
        paired = [s / f for f, s in zip(timings[faster].block_medians(),
                                        timings[slower].block_medians(), strict=True)]
        ratio = statistics.median(paired)
        figures[f"throughput_{faster}_over_{slower}"] = ratio
        print(f"throughput {faster}/{slower}: {ratio:.2f}x (per repetition: "
              f"{', '.join(f'{r:.2f}' for r in paired)})")
    warning = contention_warning(timings, device)
    if warning:
        print(f"\n{warning}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
