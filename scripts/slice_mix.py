"""`matformer slice`: per-layer FFN widths chosen by measured held-out loss within a budget.

    matformer slice runs/standalone --budget 0.6
    matformer slice runs/testnet/checkpoints/round-150 --data runs/python_docs.mdat \
        --budget 0.6 --of model --json slice.json

A nested checkpoint holds more models than its tiers: each layer's FFN can be cut at any
tier's width, as long as no layer is wider than the one before it (a Mix'n'Match slice,
``model(ids, tier=[0, 0, 1, 2])``). This measures such mixes on held-out data (the sequences
``matformer eval`` evaluates, its data options alike) and keeps the one of lowest loss whose
size is at most ``--budget`` of the whole model's: of its FFN parameters (``--of ffn``, the
default) or of all its parameters (``--of model``; the matmuls' FLOPs per token follow
the parameters, so this is the FLOP budget too). Every mix is measured when there are at
most ``--max-candidates`` of them; beyond that (deep models, many tiers) a greedy search
starts from the narrowest and widens, one layer by one tier at a time, the layer whose
widening lowers the loss most per parameter, while the budget allows.

It prints the Pareto points among the mixes it measured (none both smaller and better),
the uniform tiers beside them, and writes the chosen mix as ``SRC/mix-0-0-1-2/`` with the
checkpoint's manifest (``matformer export``'s slices, kept): a folder that opens in
``transformers`` (``trust_remote_code``: a Llama has one width for every layer) and that
``matformer eval --mix-n-match`` and ``load_for_tier`` read.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from matformer.modeling.checkpoint import load_pretrained
from matformer.modeling.checkpoint.export import export_tiers, read_manifest
from matformer.modeling.checkpoint.manifest import slice_folder
from matformer.modeling.checkpoint.slicing import sliced_parameters
from matformer.modeling.commands import command_parser
from matformer.modeling.devices import Precision, resolve_device
from matformer.modeling.errors import MatformerError
from matformer.modeling.matformer import layer_widths, tier_label
from matformer.modeling.naming import canonical_state_dict
from matformer.modeling.threads import use_threads
from matformer.modeling.training import held_out_loss
from matformer.scripts.evaluate import add_data_options, evaluated_examples, with_run_defaults

Mix = tuple[int, ...]  # the tier of each layer, never narrower before wider


@dataclass(frozen=True, slots=True)
class Point:
    """One measured slice: its per-layer tiers, its size and its held-out loss."""

    layer_tiers: Mix
    parameters: int
    ffn_parameters: int
    share: float  # of the whole model's, counted as --of says
    loss: float


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = command_parser("matformer slice", __doc__.split("\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a universal checkpoint folder")
    parser.add_argument("--budget", type=float, required=True,
                        help="the largest share of the model the slice may have, in (0, 1]")
    parser.add_argument("--of", choices=("ffn", "model"), default="ffn",
                        help="ffn: a share of the FFN parameters; model: of all parameters "
                             "(and of the matmuls' FLOPs per token)")
    parser.add_argument("--tiers", default="0,1,2",
                        help="the widths a layer may take, as tiers (comma-separated)")
    parser.add_argument("--max-candidates", type=int, default=256,
                        help="measure every mix when there are at most this many, else search "
                             "greedily")
    parser.add_argument("--no-export", action="store_true",
                        help="measure and report only; write no slice")
    add_data_options(parser)
    parser.add_argument("--json", type=Path, default=None,
                        help="write the points, the Pareto front and the choice here")
    return parser.parse_args(argv)


def mixes(tiers: Sequence[int], layers: int) -> list[Mix]:
    """Every per-layer tier list a nested model runs: widths never grow with depth."""
    return list(itertools.combinations_with_replacement(sorted(set(tiers)), layers))


def pareto(points: Sequence[Point]) -> list[Point]:
    """The points no other point matches or beats on both size and loss, smallest first."""
    front: list[Point] = []
    for point in sorted(points, key=lambda p: (p.parameters, p.loss)):
        if not front or point.loss < front[-1].loss:
            front.append(point)
    return front


class Measure:
    """Held-out loss of mixes, each measured once."""

    def __init__(self, model: torch.nn.Module, examples: list[torch.Tensor],
                 args: argparse.Namespace, device: torch.device) -> None:
        self.model, self.examples, self.args, self.device = model, examples, args, device
        self.config = model.config
        self.shapes = {name: tuple(t.shape)
                       for name, t in canonical_state_dict(model).items()}
        self.whole = sliced_parameters(self.shapes, layer_widths(
            self.config, [0] * self.config.num_hidden_layers))
        self.points: dict[Mix, Point] = {}

    def size(self, mix: Mix) -> tuple[int, int, float]:
        """(parameters, FFN parameters, share of the whole as --of counts it)."""
        total, ffn = sliced_parameters(self.shapes, layer_widths(self.config, list(mix)))
        share = ffn / self.whole[1] if self.args.of == "ffn" else total / self.whole[0]
        return total, ffn, share

    def fits(self, mix: Mix) -> bool:
        return self.size(mix)[2] <= self.args.budget + 1e-12

    def __call__(self, candidates: Sequence[Mix]) -> list[Point]:
        todo = [m for m in dict.fromkeys(candidates) if m not in self.points]
        if todo:
            losses = held_out_loss(
                self.model, self.examples, [list(m) for m in todo],
                batch_tokens=self.args.max_eval_tokens_per_microbatch,
                max_examples=self.args.max_examples_per_microbatch,
                precision=Precision(self.args.precision, self.device), seed=self.args.seed)
            for mix in todo:
                total, ffn, share = self.size(mix)
                self.points[mix] = Point(mix, total, ffn, share, losses[tier_label(list(mix))])
        return [self.points[m] for m in candidates]


def greedy(measure: Measure, tiers: Sequence[int], layers: int) -> None:
    """From the narrowest mix, widen one layer by one tier at a time (keeping widths
    non-increasing with depth), taking the move that lowers the loss most per parameter it
    adds, while a move fits the budget."""
    order = sorted(set(tiers))
    current: Mix = (order[-1],) * layers
    measure([current])

    def widened(mix: Mix) -> list[Mix]:
        moves = []
        for layer in range(layers):
            at = order.index(mix[layer])
            if at == 0:
                continue
            wider = (*mix[:layer], order[at - 1], *mix[layer + 1:])
            if (layer == 0 or wider[layer - 1] <= wider[layer]) and measure.fits(wider):
                moves.append(wider)
        return moves

    while moves := widened(current):
        here = measure.points[current]
        best = min(measure(moves), key=lambda p: (p.loss - here.loss)
                   / max(1, p.parameters - here.parameters))
        current = best.layer_tiers


def search(args: argparse.Namespace) -> dict:
    """The figures ``args`` ask for, as ``--json`` writes them; the chosen mix exported
    unless ``--no-export``."""
    if not 0 < args.budget <= 1:
        raise MatformerError(f"--budget {args.budget}: give a share of the model in (0, 1], "
                             "such as 0.6.")
    try:
        tiers = sorted({int(t) for t in args.tiers.split(",") if t.strip()})
    except ValueError:
        raise MatformerError(f"--tiers takes comma-separated integers, got "
                             f"{args.tiers!r}.") from None
    args = with_run_defaults(args)
    device = resolve_device(args.device)
    model = load_pretrained(args.checkpoint, trust_remote_code=args.trust_remote_code).to(device)
    config = model.config
    if config.matformer_tier != 0 or config.matformer_layer_tiers is not None:
        raise MatformerError(f"{args.checkpoint} is already a slice; search the universal "
                             "checkpoint it came from.")
    layers = config.num_hidden_layers
    for tier in tiers:
        layer_widths(config, tier)  # TierError for a tier this model does not have
    examples = evaluated_examples(args, config, device)
    if not examples:
        raise MatformerError("no sequences to measure on; check --data, --split and --limit.")
    measure = Measure(model, examples, args, device)
    narrowest = (max(tiers),) * layers
    if not measure.fits(narrowest):
        raise MatformerError(
            f"--budget {args.budget} is below the narrowest slice of tiers {tiers} "
            f"({measure.size(narrowest)[2]:.3f} of the {args.of} parameters); raise it, or "
            "add a deeper tier to --tiers.")
    everything = mixes(tiers, layers)
    exhaustive = len(everything) <= args.max_candidates
    if exhaustive:
        measure([m for m in everything if measure.fits(m)])
    else:
        greedy(measure, tiers, layers)
    uniform = measure([(t,) * layers for t in tiers])
    measured = list(measure.points.values())
    within = [p for p in measured if p.share <= args.budget + 1e-12]
    chosen = min(within, key=lambda p: (p.loss, p.parameters))
    exported = None
    if not args.no_export:
        exported = export_mix(args.checkpoint, chosen.layer_tiers)
    return {
        "checkpoint": str(args.checkpoint), "budget": args.budget, "of": args.of,
        "tiers": tiers, "search": "exhaustive" if exhaustive else "greedy",
        "mixes": len(everything), "measured": len(measured),
        "sequences": len(examples), "tokens": sum(len(e) for e in examples),
        "chosen": asdict(chosen), "uniform": [asdict(p) for p in uniform],
        "pareto": [asdict(p) for p in pareto(measured)],
        "points": [asdict(p) for p in sorted(measured, key=lambda p: p.parameters)],
        "exported": None if exported is None else str(exported),
    }


def export_mix(source: Path, mix: Mix) -> Path | None:
    """``mix``'s slice written beside ``source``'s other slices (those its manifest lists
    are written again, so none is lost); None when the mix is tier 0, the checkpoint
    itself."""
    if set(mix) == {0}:
        return None
    manifest = read_manifest(source)
    entries = [] if manifest is None else [e.tier for e in manifest.tiers if e.tier != 0]
    uniform = len(set(mix)) == 1
    tiers = sorted({t for t in entries if isinstance(t, int)} | ({mix[0]} if uniform else set()))
    mixes_ = [list(t) for t in entries if isinstance(t, tuple) and t != mix]
    export_tiers(source, tiers, [*mixes_, *([] if uniform else [list(mix)])])
    return source / slice_folder(mix[0] if uniform else list(mix))


def report(figures: dict, say: Callable[[str], None] = print) -> None:
    of = "FFN" if figures["of"] == "ffn" else "all"
    say(f"{figures['checkpoint']}: {figures['measured']} of {figures['mixes']} mixes measured "
        f"({figures['search']}) on {figures['sequences']:,} sequences, "
        f"{figures['tokens']:,} tokens; budget {figures['budget']:g} of {of} parameters")
    say(f"{'layer tiers':<24} {'share':>6} {'parameters':>12} {'loss':>8}")
    for point in figures["pareto"]:
        mark = "  <- chosen" if point["layer_tiers"] == figures["chosen"]["layer_tiers"] else ""
        say(f"{','.join(map(str, point['layer_tiers'])):<24} {point['share']:6.3f} "
            f"{point['parameters']:12,} {point['loss']:8.4f}{mark}")
    for point in figures["uniform"]:
        say(f"uniform tier {point['layer_tiers'][0]}: share {point['share']:.3f}, loss "
            f"{point['loss']:.4f}")
    chosen = figures["chosen"]
    fitting = [p for p in figures["uniform"] if p["share"] <= figures["budget"] + 1e-12]
    if fitting:
        best = min(fitting, key=lambda p: p["loss"])
        say(f"chosen {','.join(map(str, chosen['layer_tiers']))}: loss {chosen['loss']:.4f} "
            f"at {chosen['share']:.3f}, against {best['loss']:.4f} for uniform tier "
            f"{best['layer_tiers'][0]} at {best['share']:.3f} "
            f"({(chosen['loss'] - best['loss']) / best['loss']:+.2%})")
    if figures["exported"]:
        say(f"wrote {figures['exported']} and the manifest beside it")
    if len(set(chosen["layer_tiers"])) > 1:
        say(f"a federated run trains it as a tier with run.toml's [tiers] layer_mixes = "
            f"[{chosen['layer_tiers']}]: tier 64, a slice beside each of its checkpoints")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        use_threads(args.threads)
        figures = search(args)
    except MatformerError as error:
        print(f"matformer slice: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    report(figures)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1) + "\n")


if __name__ == "__main__":
    main()
