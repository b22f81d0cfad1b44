"""The JSON schema of run.toml, train.toml or a strategy file, for editors and CI.

Derived from the same declarations that check the file (modeling/settings.py), so a file the
schema accepts is one whose keys, types, ranges and choices the command accepts too.

    matformer schema run > run.schema.json
    matformer schema strategy --out strategy.schema.json
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matformer.modeling.commands import command_parser


def _run() -> dict[str, Any]:
    from matformer.server.config import run_schema

    return run_schema()


def _train() -> dict[str, Any]:
    from matformer.client.train_config import train_schema

    return train_schema()


def _strategy() -> dict[str, Any]:
    from matformer.modeling.mdat.strategy import strategy_schema

    return strategy_schema()


# file kind → its schema (imported when asked: the run's brings the server package)
SCHEMAS: dict[str, Callable[[], dict[str, Any]]] = {
    "run": _run, "train": _train, "strategy": _strategy}


def main(argv: list[str] | None = None) -> int:
    parser = command_parser("matformer-schema", __doc__.split("\n")[0])
    parser.add_argument("kind", choices=list(SCHEMAS),
                        help="run: run.toml; train: train.toml; strategy: a strategy JSON file")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the schema here instead of printing it")
    args = parser.parse_args(argv)
    text = json.dumps(SCHEMAS[args.kind](), indent=2) + "\n"
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
