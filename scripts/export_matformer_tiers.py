"""`matformer-export-tiers`: write tier slices of a universal checkpoint and their manifest."""

from __future__ import annotations

import logging
from pathlib import Path

from matformer.modeling.checkpoint.export import export_tiers
from matformer.modeling.checkpoint.manifest import slice_folder
from matformer.modeling.commands import command_parser
from matformer.modeling.errors import MatformerError
from matformer.modeling.matformer import tier_label


def main(argv: list[str] | None = None) -> None:
    parser = command_parser("matformer-export-tiers", __doc__)
    parser.add_argument("--src", type=Path, required=True, help="universal checkpoint directory")
    parser.add_argument("--tiers", type=int, nargs="*", default=[], help="tiers to export")
    parser.add_argument("--mix-n-match", nargs="*", default=[], metavar="T0,T1,...",
                        help="per-layer tier lists, e.g. 0,0,1,2 (width never grows with depth)")
    args = parser.parse_args(argv)
    if not args.tiers and not args.mix_n_match:
        parser.error("give --tiers and/or --mix-n-match")
    try:
        mixes = [[int(t) for t in spec.split(",")] for spec in args.mix_n_match]
    except ValueError:
        parser.error(f"--mix-n-match takes comma-separated integers, got {args.mix_n_match}")
    logging.basicConfig(format="matformer-export-tiers: %(message)s", level=logging.WARNING)
    try:
        manifest = export_tiers(args.src, args.tiers, mixes)
    except MatformerError as err:
        parser.exit(2, f"matformer-export-tiers: error: {err}\n")
    for entry in manifest.tiers:
        where = args.src if entry.tier == 0 else args.src / slice_folder(entry.tier)
        print(f"tier {tier_label(entry.tier)}: intermediate_size {entry.intermediate_size}, "
              f"{len(entry.files)} files in {where}")
    print(f"wrote {args.src / 'matformer_manifest.json'}")


if __name__ == "__main__":
    main()
