"""`matformer-generate`: what a checkpoint writes at a chosen tier.

    matformer-generate runs/standalone --tier 2 --prompt "def read_file(path):"
    matformer-generate CHECKPOINT --tier 0 --prompt "..." --temperature 0 --max-new-tokens 200

Text goes through the checkpoint's own ``tokenizer.json`` (``matformer-train`` saves it with
the model), else through the tokenizer of an MDAT strategy (``--data MDAT --strategy S``), the
``tokenizer.json`` that ``--tokenizer`` names, or bytes (``--tokenizer bytes``, the
embedded corpus's; the default for a checkpoint without a tokenizer). Sampling:
``--temperature`` (0: greedy), ``--top-k``, ``--top-p``, ``--seed``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from matformer.modeling import trust
from matformer.modeling.checkpoint import load_pretrained
from matformer.modeling.commands import command_parser
from matformer.modeling.devices import resolve_device
from matformer.modeling.errors import MatformerError
from matformer.modeling.generation import generate
from matformer.modeling.mdat import DEFAULT_STRATEGY, Mdat
from matformer.modeling.mdat.pretok_files import TOKENIZER_FILE
from matformer.modeling.mdat.pretok_workers import build_splitter
from matformer.modeling.threads import add_threads_option, use_threads
from matformer.modeling.tokenizers import build_text_tokenizer
from matformer.modeling.tokenizers.text import TextTokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser("matformer-generate", __doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder (config.json, weights)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--tier", type=int, default=None,
                        help="the tier to run (default: the checkpoint's own: 0 for a "
                             "universal checkpoint, its tier for a slice)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None,
                        help="bytes, or a tokenizer.json (default: the checkpoint's own, else "
                             "bytes)")
    parser.add_argument("--data", type=Path, default=None,
                        help="an MDAT: use the tokenizer of its --strategy instead")
    parser.add_argument("--strategy", default=DEFAULT_STRATEGY["strategy_name"])
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | mps")
    add_threads_option(parser)
    trust.add_option(parser)
    parser.add_argument("--no-cache", action="store_true",
                        help="recompute every position at every step (for checking)")
    return parser.parse_args(argv)


def text_tokenizer(args: argparse.Namespace) -> TextTokenizer:
    """The tokenizer of ``--data``'s ``--strategy``, else ``--tokenizer``'s, else the
    checkpoint's own, else bytes."""
    if args.data is not None:
        with Mdat.open(args.data) as mdat:
            return build_splitter(mdat.path, mdat.strategy(args.strategy),
                                  args.trust_remote_code).tokenizer
    own = args.checkpoint / TOKENIZER_FILE
    if args.tokenizer is None and own.is_file():
        return build_text_tokenizer("huggingface", own)
    if args.tokenizer in (None, "bytes"):
        return build_text_tokenizer("bytes", None)
    return build_text_tokenizer("huggingface", Path(args.tokenizer))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        use_threads(args.threads)
        text = text_tokenizer(args)
        device = resolve_device(args.device)
        model = load_pretrained(args.checkpoint,
                                trust_remote_code=args.trust_remote_code).to(device)
        guessed = args.data is None and args.tokenizer is None and not (
            args.checkpoint / TOKENIZER_FILE).is_file()  # bytes, for want of another
        if text.vocab_size > model.config.vocab_size or (
                guessed and text.vocab_size != model.config.vocab_size):
            raise MatformerError(
                f"the tokenizer has {text.vocab_size:,} ids and the model "
                f"{model.config.vocab_size:,}: they were not trained together; give the "
                "model's own with --tokenizer tokenizer.json or --data MDAT --strategy S.")
        prompt = torch.tensor(text.encode(args.prompt)[0], dtype=torch.long, device=device)
        ids = generate(model, prompt, tier=args.tier, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                       eos_token_id=text.eos_token_id,
                       generator=torch.Generator().manual_seed(args.seed),
                       use_cache=not args.no_cache)
    except MatformerError as error:
        print(f"matformer-generate: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    new = [int(i) for i in ids[len(prompt):] if int(i) != text.eos_token_id]
    print(args.prompt + text.decode(new))


if __name__ == "__main__":
    main()
