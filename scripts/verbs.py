"""`matformer <verb>`: every Matformer command behind one name.

    matformer testnet --num-clients 3 --tiers 0,1,2
    matformer server --config run.toml
    matformer client train --server HOST:PORT --tier 1
    matformer train --steps 200
    matformer keys add alice --config run.toml
    matformer schema run

Each verb runs the command of the same job (``matformer-server``, ``matformer-train``,
``local-testnet``…, which stay as they are) with the rest of the line, and its usage and
errors name it as ``matformer <verb>``. A verb's module is imported only when it runs, so
``matformer --help`` answers at once.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from matformer.modeling import commands
from matformer.modeling.errors import did_you_mean

PROG = "matformer"
# verb → (the module, below matformer., and the function that run it, a leading argument it
# takes, what it does)
VERBS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "testnet": ("local_testnet.main:main", (), "a whole federated run on this machine"),
    "server": ("server.main:main", (), "coordinate a federated run (its run.toml)"),
    "client": ("client.cli:main", (), "join a run as a member: matformer client train ..."),
    "relay": ("relay.main:main", (), "a relay: one member to the root, a coordinator near"
              " its members"),
    "shard": ("server.shards:main", (), "one shard of a coordinator's close, on another "
              "machine ([coordinator] shard_host)"),
    "keys": ("server.main:main", ("keys",), "the member keys of a run with [auth] mode keys"),
    "train": ("client.standalone:main", (), "train on this machine alone"),
    "eval": ("scripts.evaluate:main", (), "held-out loss and perplexity per tier"),
    "generate": ("scripts.generate:main", (), "text from a checkpoint, at a tier"),
    "mdat": ("scripts.mdat_cli:main", (), "build and inspect MDAT dataset containers"),
    "export": ("scripts.export_matformer_tiers:main", (), "a checkpoint's tier slices"),
    "push": ("scripts.push:main", (), "publish a checkpoint, its slices and manifest to the hub"),
    "slice": ("scripts.slice_mix:main", (), "per-layer FFN widths chosen by held-out loss "
              "within a budget"),
    "convert": ("scripts.convert:main", (), "a dense model made nested (FFN neurons ordered)"),
    "schema": ("scripts.schema:main", (), "the JSON schema of run.toml, train.toml or a strategy"),
}


def usage() -> str:
    width = max(map(len, VERBS))
    lines = [f"usage: {PROG} <verb> [options]   ({PROG} <verb> --help for a verb's options)",
             "", "verbs:"]
    lines += [f"  {verb:<{width}}  {about}" for verb, (_, _, about) in VERBS.items()]
    lines += ["", f"  --version  {PROG}'s version"]
    return "\n".join(lines)


def runner(verb: str) -> Callable[[list[str]], Any]:
    """The function that runs ``verb``, imported now."""
    target, _, _ = VERBS[verb]
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(f"matformer.{module}"), function)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] == "--version":  # as every command says it (commands.command_parser)
        commands.command_parser(PROG).parse_args(["--version"])
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"{PROG}: error: no verb {verb!r}; {did_you_mean(verb, list(VERBS))}"
              f"verbs: {', '.join(VERBS)}.", file=sys.stderr)
        return 2
    commands.invoked_as = f"{PROG} {verb}"
    try:
        return runner(verb)([*VERBS[verb][1], *rest]) or 0
    finally:
        commands.invoked_as = None


if __name__ == "__main__":
    sys.exit(main())
