"""`matformer-export-tiers`: write tier slices of a universal checkpoint and their manifest."""

from __future__ import annotations

import argparse
from pathlib import Path

from modeling.checkpoint.export import export_tiers
from modeling.errors import MatformerError


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="matformer-export-tiers", description=__doc__)
    parser.add_argument("--src", type=Path, required=True, help="universal checkpoint directory")
    parser.add_argument("--tiers", type=int, nargs="+", required=True, help="tiers to export")
    args = parser.parse_args(argv)
    try:
        manifest = export_tiers(args.src, args.tiers)
    except MatformerError as err:
        parser.exit(2, f"matformer-export-tiers: error: {err}\n")
    for entry in manifest.tiers:
        print(f"tier {entry.tier}: intermediate_size {entry.intermediate_size}, "
              f"{len(entry.files)} files")
    print(f"wrote {args.src / 'matformer_manifest.json'}")


if __name__ == "__main__":
    main()
