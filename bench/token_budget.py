"""Token-budget batches against fixed-size padded batches on a mixed-length corpus.

The corpus is the standard library's docstrings (``modeling.corpus.python_docs``) as bytes
(``ByteTokenizer``, one EOS each), truncated at ``--max-len``: lengths span 25x with the
defaults, most documents short, a few long. Both contenders train the same model (same
initial weights, AdamW) for one epoch over the same documents, so they process the same
real tokens:

- ``fixed``: ``--batch-size`` documents per step in data order, each batch padded to its
  own longest document (dynamic padding, as Hugging Face's DataCollatorWithPadding does).
- ``budget``: ``plan_batches`` with a budget of batch size x max length padded tokens, the
  most a fixed batch can hold, so both fit in the same memory; sorted by length within
  runs of ``--sort-window`` batches' worth of tokens. Each batch is cut by
  ``split_microbatches`` (``--microbatch-tokens``, default: the budget, one pass per batch).

Each step runs ``accumulate_gradients`` and an optimizer step. Padding waste is padded
minus real tokens over padded tokens fed to the model. Epochs run interleaved (see
bench/harness.py); the throughput ratio is the median of the per-repetition ratios.

    python bench/token_budget.py
    python bench/token_budget.py --docs 4000 --hidden-size 128 --sort-window 0
"""

from __future__ import annotations

import argparse
import copy
import statistics

import torch
from harness import DTYPES, Step, contention_warning, print_table, setup, time_interleaved
from torch import Tensor

from modeling import AutoregressiveModel, ModelConfig
from modeling.batching import (
    accumulate_gradients,
    padded_tokens,
    plan_batches,
    split_microbatches,
)
from modeling.corpus import python_docs
from modeling.optim import OptimizerConfig
from modeling.tokenizers import ByteTokenizer

Plan = list[tuple[list[int], list[list[int]]]]  # per step: batch indices, its microbatches


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    data = parser.add_argument_group("corpus and batching")
    data.add_argument("--docs", type=int, default=1500, help="documents in the corpus")
    data.add_argument("--min-chars", type=int, default=20, help="shortest docstring kept")
    data.add_argument("--max-len", type=int, default=512, help="tokens a document is cut to")
    data.add_argument("--batch-size", type=int, default=4,
                      help="documents per fixed batch; budget = batch size x max length")
    data.add_argument("--sort-window", type=int, default=64,
                      help="batches' worth of tokens sorted by length together (0: off)")
    data.add_argument("--microbatch-tokens", type=int, default=None,
                      help="padded tokens per forward/backward (default: the whole budget)")
    model = parser.add_argument_group("model")
    model.add_argument("--hidden-size", type=int, default=64)
    model.add_argument("--layers", type=int, default=2)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--kv-heads", type=int, default=2)
    model.add_argument("--intermediate-size", type=int, default=256)
    run = parser.add_argument_group("run")
    run.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    run.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    run.add_argument("--threads", type=int, default=None,
                     help="CPU threads for torch (default: every core this process may use)")
    run.add_argument("--repeats", type=int, default=3, help="timed epochs per contender")
    run.add_argument("--warmup", type=int, default=4, help="untimed steps per contender first")
    run.add_argument("--lr", type=float, default=1e-4)
    run.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def corpus(args: argparse.Namespace, device: torch.device) -> list[Tensor]:
    tokenizer = ByteTokenizer()
    return [
        torch.tensor(tokenizer.encode(doc, add_eos=True)[: args.max_len], device=device)
        for doc in python_docs(limit=args.docs, min_chars=args.min_chars)
    ]


def plans(args: argparse.Namespace, lengths: list[int]) -> dict[str, Plan]:
    budget = args.batch_size * args.max_len
    fixed = [
        list(range(start, min(start + args.batch_size, len(lengths))))
        for start in range(0, len(lengths), args.batch_size)
    ]
    planned = plan_batches(lengths, budget, sort_window=args.sort_window)
    microbatch_tokens = args.microbatch_tokens or budget
    return {
        "fixed": [(batch, [list(range(len(batch)))]) for batch in fixed],
        "budget": [
            (batch, split_microbatches(
                [lengths[i] for i in batch], max_tokens=microbatch_tokens, max_examples=len(batch)
            ))
            for batch in planned
        ],
    }


def epoch(model: AutoregressiveModel, args: argparse.Namespace, examples: list[Tensor],
          plan: Plan, steps: int | None = None) -> Step:
    """One pass over ``plan`` (its first ``steps`` steps, if given)."""
    optimizer = OptimizerConfig(
        name="adamw", lr=args.lr, total_steps=10**6, schedule="constant"
    ).build(model)
    pad = ByteTokenizer.pad_token_id

    def run() -> None:
        for batch, microbatches in plan[:steps]:
            accumulate_gradients(model, [examples[i] for i in batch], microbatches, pad_value=pad)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    return run


def fed_tokens(plan: Plan, lengths: list[int]) -> int:
    """Padded tokens the model sees over ``plan``: each microbatch pads to its longest."""
    return sum(
        padded_tokens([lengths[batch[i]] for i in microbatch])
        for batch, microbatches in plan
        for microbatch in microbatches
    )


def main() -> None:
    args = parse_args()
    device, dtype = setup(args)
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
    models = {"fixed": first, "budget": copy.deepcopy(first)}
    schedules = plans(args, lengths)
    for name, model in models.items():
        epoch(model, args, examples, schedules[name], steps=args.warmup)()
    epochs = {
        name: epoch(model, args, examples, schedules[name]) for name, model in models.items()
    }
    print(
        f"corpus: {len(lengths)} docs, {sum(lengths):,} tokens, lengths {min(lengths)}-"
        f"{max(lengths)} ({max(lengths) / min(lengths):.0f}x), median "
        f"{statistics.median(lengths):.0f} | budget {args.batch_size * args.max_len} padded "
        f"tokens, sort window {args.sort_window} | model hidden {args.hidden_size}, "
        f"{args.layers} layers, {args.dtype}, {device}, {torch.get_num_threads()} threads"
    )
    timings = time_interleaved(
        epochs, device, timed=args.repeats, repeats=args.repeats, warmup=0
    )
    real = sum(lengths)
    rows = []
    for name, timing in timings.items():
        plan, fed = schedules[name], fed_tokens(schedules[name], lengths)
        rows.append([
            name,
            f"{len(plan):,}",
            f"{len(lengths) / len(plan):.1f}",
            f"{sum(len(m) for _, m in plan) / len(plan):.2f}",
            f"{fed:,}",
            f"{1 - real / fed:.1%}",
            f"{timing.median:.2f}",
            f"{real / timing.median:,.0f}",
            timing.cpu_use(device),
        ])
    print()
    print_table(
        ["batching", "steps", "docs/step", "passes/step", "padded tokens", "waste", "s/epoch",
         "real tokens/s", "cpu use"],
        rows,
    )
    paired = [
        f / b for f, b in zip(
            timings["fixed"].block_medians(), timings["budget"].block_medians(), strict=True
        )
    ]
    print(
        f"\nthroughput budget/fixed: {statistics.median(paired):.2f}x (per repetition: "
        f"{', '.join(f'{r:.2f}' for r in paired)}; > 1 means token budgets are faster)"
    )
    warning = contention_warning(timings, device)
    if warning:
        print(f"\n{warning}")


if __name__ == "__main__":
    main()
