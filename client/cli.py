"""`matformer-client`: the command a participant runs.

``matformer-client train`` trains on one machine: the baseline a federated run is compared
with, on the same data path (MDAT sequences, token-budget microbatches, several tiers per step).
"""

from __future__ import annotations

import argparse

from client.standalone import add_arguments, run


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="matformer-client", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    add_arguments(commands.add_parser(
        "train", help="train standalone on an MDAT (default: the embedded stdlib corpus)"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    run(parse_args(argv), "matformer-client")


if __name__ == "__main__":
    main()
