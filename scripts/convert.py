"""`matformer-convert`: a dense Llama checkpoint made nested, its FFN neurons sorted by
importance so that every tier's prefix is the best slice of its size.

    matformer-convert runs/dense runs/nested --tiers 1 2
    matformer-convert ./llama-hf runs/nested --score activations --data runs/python_docs.mdat

The source is one of ours or a Hugging Face Llama folder; the output is a new checkpoint
that computes the same function (the permutation changes only which neurons each tier
holds), with the source's tokenizer files and a ``matformer_neuron_order`` record in its
``config.json``. ``--score weights`` needs no data; ``--score activations`` measures each
neuron on calibration sequences of an MDAT container (``modeling/checkpoint/neuron_order.py``
says what each score measures and why).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import NoReturn

from matformer.modeling.checkpoint import read_config
from matformer.modeling.checkpoint.neuron_order import Calibration, convert
from matformer.modeling.commands import command_parser
from matformer.modeling.devices import resolve_device
from matformer.modeling.errors import MatformerError, TierError
from matformer.modeling.matformer import layer_widths
from matformer.modeling.mdat import DEFAULT_STRATEGY

PROG = "matformer-convert"


def fail(message: str) -> NoReturn:
    """One line on stderr and exit status 2, as every refusal of bad input ends."""
    print(f"{PROG}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> None:
    parser = command_parser(PROG, __doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="dense checkpoint folder (ours or Hugging "
                        "Face Llama)")
    parser.add_argument("out", type=Path, help="new folder for the converted checkpoint")
    parser.add_argument("--score", choices=("weights", "activations"), default="weights",
                        help="weights: norms of each neuron's weights; activations: its mean "
                             "output on --data")
    parser.add_argument("--data", type=Path, default=None,
                        help="MDAT container of the calibration sequences (--score activations)")
    parser.add_argument("--calibration-sequences", type=int, default=64)
    parser.add_argument("--strategy", default=DEFAULT_STRATEGY["strategy_name"])
    parser.add_argument("--view", default=None, help="view of the container (default: all)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0,
                        help="of the shuffle whose training part calibrates")
    parser.add_argument("--tiers", type=int, nargs="*", default=[],
                        help="tier slices to export into the output, e.g. 1 2")
    parser.add_argument("--device", default="cpu", help="where calibration runs")
    args = parser.parse_args(argv)
    logging.basicConfig(format=f"{PROG}: %(message)s", level=logging.WARNING)
    calibration = None
    if args.score == "activations":
        if args.data is None:
            fail("--score activations needs --data MDAT, the container whose sequences it "
                 "measures (e.g. runs/python_docs.mdat); or use --score weights")
        calibration = Calibration(args.data, args.calibration_sequences, args.strategy,
                                  args.view, args.seq_len, args.seed)
    elif args.data is not None:
        fail("--data is read by --score activations only; add --score activations or drop it")
    try:
        done = convert(args.source, args.out, calibration=calibration, tiers=args.tiers,
                       device=resolve_device(args.device))
    except MatformerError as err:
        fail(str(err))
    print(f"wrote {done.out}: FFN neurons ordered by the {done.score} score")
    config = read_config(done.out)
    for tier in args.tiers or [1]:
        try:
            widths = layer_widths(config, tier)
        except TierError:
            continue  # an odd width has no tier 1: nothing to say
        before, after = done.kept(widths)
        print(f"tier {tier} (first {widths[0]:,} neurons of each layer) holds {after:.1%} of "
              f"the score; unordered, {before:.1%}")
    if done.manifest is not None:
        print(f"tier slices: {', '.join(f'tier{t}/' for t in sorted(set(args.tiers)))} and "
              "matformer_manifest.json")


if __name__ == "__main__":
    main()
