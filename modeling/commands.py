"""What every matformer command line shares: ``--version``, and each option's default shown in
``--help``.

    parser = command_parser("matformer-eval", "Held-out loss per tier of a checkpoint.")
"""

from __future__ import annotations

import argparse
import copy
from importlib import metadata

import torch

DISTRIBUTION = "matformer"
# the name a command runs under when ``matformer <verb>`` runs it (scripts/matformer.py):
# its usage and errors then say "matformer train", not "matformer-train"
invoked_as: str | None = None


def version() -> str:
    """This installation's version, as pip knows it."""
    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return "unknown (not installed; pip install -e .)"


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
