"""What every matformer command line shares: ``--version``, each option's default shown in
``--help``, and ``--set SECTION.KEY=VALUE`` overrides of a settings file.

    parser = command_parser("matformer-eval", "Held-out loss per tier of a checkpoint.")
"""

from __future__ import annotations

import argparse
import copy
import re
import tomllib
from collections.abc import Iterable
from typing import Any

import torch

import matformer
from matformer.modeling.errors import InvalidValue, WrongType

# the name a command runs under when ``matformer <verb>`` runs it (scripts/verbs.py):
# its usage and errors then say "matformer train", not "matformer-train"
invoked_as: str | None = None


def version() -> str:
    """This installation's version, as pip knows it."""
    return matformer.__version__


class DefaultsShown(argparse.HelpFormatter):
    """Help that ends each option's line with its default, unless the help names one already
    or there is none to name (None, False, a required option, a positional)."""

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and _named(action):
            action = copy.copy(action)
            action.help = "default: %(default)s"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if not _named(action) or "default" in text.lower():
            return action.help
        return f"{text} (default: %(default)s)"


def _named(action: argparse.Action) -> bool:
    """Whether ``action`` has a default worth showing."""
    return bool(action.option_strings) and not action.required and not any(
        action.default is nothing for nothing in (None, False, argparse.SUPPRESS))


def command_parser(prog: str, description: str | None = None, *, epilog: str | None = None
                   ) -> argparse.ArgumentParser:
    """A command's parser: ``--version`` and defaults in ``--help``."""
    prog = invoked_as or prog
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=epilog,
                                     formatter_class=DefaultsShown)
    parser.add_argument("--version", action="version",
                        version=f"%(prog)s {version()} (torch {torch.__version__})")
    return parser


_BARE_WORD = re.compile(r"[^\s\"'\[\]{}=]+")  # an unquoted --set string value


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """A copy of the parsed ``data`` with each ``--set SECTION.KEY=VALUE`` applied in order
    (VALUE in TOML syntax; a bare word that is not TOML is a string). A key the file would
    not accept is refused by its reader, in the same words as in the file."""
    data = copy.deepcopy(data)
    for text in overrides:
        key, sep, raw = text.partition("=")
        path, raw = [part.strip() for part in key.split(".")], raw.strip()
        if not sep or len(path) < 2 or not all(path):
            raise InvalidValue(f"--set {text!r} is not SECTION.KEY=VALUE; write e.g. "
                               "--set round.rounds=5.")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            if not _BARE_WORD.fullmatch(raw):
                raise InvalidValue(f"--set {text!r}: {raw!r} is not a TOML value; quote "
                                   "strings, e.g. --set run.id='\"my-run\"'.") from None
            value = raw
        table = data
        for i, part in enumerate(path[:-1]):
            table = table.setdefault(part, {})
            if not isinstance(table, dict):
                raise WrongType(f"--set {text!r}: {'.'.join(path[:i + 1])} is not a table.")
        table[path[-1]] = value
    return data
