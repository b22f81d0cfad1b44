"""Real English text that every Python install already has: the standard library's docstrings.

Examples and smoke tests need natural language to train on, but must not depend on a download.
The stdlib's docstrings are written prose about code, and reading them through `ast` never
executes or imports a module. The text is deterministic for a given Python version.
"""

from __future__ import annotations

import ast
import os
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

import torch

# Third-party packages are not stdlib prose; test suites are mostly boilerplate docstrings.
_SKIPPED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3"})
_DOC_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


class TextEncoder(Protocol):
    """What `python_docs_tokens` needs from a tokenizer (ByteTokenizer qualifies)."""

    eos_token_id: int

    def encode(self, text: str) -> list[int]: ...


def python_docs(limit: int | None = None, min_chars: int = 200) -> Iterator[str]:
    """Yield stdlib module, class and function docstrings of at least `min_chars` characters.

    Files are visited in sorted path order and docstrings in `ast.walk` order, so the sequence
    is the same on every run; `limit` caps how many documents are yielded.
    """
    if limit is not None and limit <= 0:
        return
    count = 0
    for path in _stdlib_sources():
        tree = _parse(path)
        if tree is None:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, _DOC_NODES):
                continue
            doc = ast.get_docstring(node, clean=True)
            if doc is None or len(doc) < min_chars:
                continue
            yield doc
            count += 1
            if count == limit:
                return


def python_docs_tokens(tokenizer: TextEncoder, *, max_tokens: int) -> torch.Tensor:
    """Encoded docstrings, each followed by EOS, as one 1-D long tensor of <= max_tokens ids."""
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    ids: list[int] = []
    for doc in python_docs():
        ids.extend(tokenizer.encode(doc))
        ids.append(tokenizer.eos_token_id)
        if len(ids) >= max_tokens:
            break
    return torch.tensor(ids[:max_tokens], dtype=torch.long)  # (max_tokens,) or fewer


def _stdlib_sources() -> Iterator[Path]:
    root = sysconfig.get_paths()["stdlib"]
    for dirpath, dirnames, filenames in os.walk(root):
        # Sorting in place also fixes the order os.walk descends in.
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield Path(dirpath, name)


def _parse(path: Path) -> ast.Module | None:
    """The module's syntax tree, or None for files this Python cannot read or parse."""
    try:
        source = path.read_bytes()
        # Old escape sequences in some files raise Syntax/DeprecationWarnings that are noise here.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return ast.parse(source, filename=str(path))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return None
