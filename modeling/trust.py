"""Consent to run code that arrived with a file: a checkpoint's module files, an MDAT
container's ``functions/``. As with transformers' ``trust_remote_code``, such code is
imported only when the user says so, in Python (``trust_remote_code=True``) or on a command
(``--trust-remote-code``); without it a model or strategy must be built from components
registered here. One option and one message for every command, so the rule reads the same
everywhere.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path

OPTION = "--trust-remote-code"


def add_option(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        OPTION, action="store_true",
        help="run the Python files a checkpoint or MDAT container carries (its own model "
             "components, splitters, tokenizers); read them first: they run with your rights")


def refusal(source: str | Path, files: Iterable[str | Path], needed_for: str) -> str:
    """The message of a refusal to run ``files`` that came with ``source``."""
    names = ", ".join(str(f) for f in files)
    return (f"{source} carries code of its own ({names}) that {needed_for}. Matformer runs "
            "such code only when you allow it: read those files, then pass "
            f"trust_remote_code=True (Python) or {OPTION} (commands).")
