"""`matformer-generate`: what a checkpoint writes at a chosen tier.

    matformer-generate runs/standalone --tier 2 --prompt "def read_file(path):"
    matformer-generate CHECKPOINT --tier 0 --prompt "..." --temperature 0 --max-new-tokens 200

Text goes through bytes (``ByteTokenizer``, the embedded corpus's tokenizer) unless
``--tokenizer`` names a ``tokenizer.json`` (the file of the MDAT strategy the model was
trained on). Sampling: ``--temperature`` (0: greedy), ``--top-k``, ``--top-p``, ``--seed``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from modeling.checkpoint import load_pretrained
from modeling.devices import resolve_device
from modeling.errors import MatformerError, TokenizerNotFound
from modeling.generation import generate
from modeling.tokenizers import ByteTokenizer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="matformer-generate",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder (config.json, weights)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--tier", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default="bytes", help="bytes, or a tokenizer.json")
    parser.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N | mps")
    parser.add_argument("--no-cache", action="store_true",
                        help="recompute every position at every step (for checking)")
    return parser.parse_args(argv)


class _Text:
    """encode/decode through bytes or a Hugging Face ``tokenizers`` file."""

    def __init__(self, name: str) -> None:
        self.eos_token_id: int | None = ByteTokenizer.eos_token_id
        if name == "bytes":
            self._bytes = ByteTokenizer()
            return
        from tokenizers import Tokenizer

        if not Path(name).is_file():
            raise TokenizerNotFound(f"--tokenizer {name!r} is neither 'bytes' nor a "
                                    "tokenizer.json file.")
        self._bytes = None
        self._file = Tokenizer.from_file(name)
        self.eos_token_id = None

    def encode(self, text: str) -> list[int]:
        return self._bytes.encode(text) if self._bytes else self._file.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self._bytes.decode(ids) if self._bytes else self._file.decode(ids)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        text = _Text(args.tokenizer)
        device = resolve_device(args.device)
        model = load_pretrained(args.checkpoint).to(device)
        prompt = torch.tensor(text.encode(args.prompt), dtype=torch.long, device=device)
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
