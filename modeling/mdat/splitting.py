"""A strategy made runnable: its tokenizer and splitter built, and their output checked.

Splitters come from the registry (built-ins in `modeling.mdat.splitters`, custom ones from
``.py`` files in the container's ``functions/`` folder, loaded when a strategy is built).
Whatever a splitter returns is checked before it is stored, so a buggy custom splitter fails
on the document that exposed it instead of corrupting sequences later.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from modeling.errors import RegistryError, SplitterError, StrategyError, UnknownSplitter
from modeling.mdat import splitters as _builtin_splitters  # noqa: F401  (registers built-ins)
from modeling.mdat import text_tokenizers as _builtin_tokenizers  # noqa: F401
from modeling.mdat.strategy import Strategy
from modeling.registry import registry


class DocumentSplitter:
    """Turns one document into (tokens, chunk lengths) the way ``strategy`` says."""

    def __init__(self, strategy: Strategy, functions: Path, tokenizer_file: Path | None) -> None:
        registry.load_modules(functions)
        self.strategy = strategy
        self.tokenizer = _build_tokenizer(strategy, tokenizer_file)
        self._splitter = _build_splitter(strategy, self.tokenizer, functions)

    def resolved(self) -> Strategy:
        """The strategy with the vocabulary size and special ids it left open filled in."""
        s, tok = self.strategy, self.tokenizer
        if s.vocab_size is not None and s.vocab_size < tok.vocab_size:
            raise StrategyError(
                f"strategy {s.name!r}: vocab_size {s.vocab_size} is smaller than its "
                f"tokenizer's {tok.vocab_size}; raise it or leave it out."
            )
        return replace(
            s, vocab_size=s.vocab_size or tok.vocab_size,
            bos_token_id=s.bos_token_id if s.bos_token_id is not None else tok.bos_token_id,
            eos_token_id=s.eos_token_id if s.eos_token_id is not None else tok.eos_token_id,
            mask_token_id=s.mask_token_id if s.mask_token_id is not None else tok.mask_token_id,
        )

    def split(self, document: dict[str, Any], where: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids (n,) and chunk lengths (c,) of ``document``; ``where`` names it in errors."""
        s = self.strategy
        try:
            result = self._splitter(document, **(s.splitter_arguments or {}))
        except Exception as err:
            raise SplitterError(
                f"splitter {s.splitter_class!r} failed on {where}: {err!r}. Fix the splitter; "
                "pretokenize resumes from the last committed batch."
            ) from err
        checked = _checked(s, result)
        if isinstance(checked, str):
            raise SplitterError(
                f"splitter {s.splitter_class!r} returned an invalid result for {where}: "
                f"{checked}. Fix the splitter; nothing of this document was stored."
            )
        return checked


def _checked(strategy: Strategy, result: Any) -> tuple[np.ndarray, np.ndarray] | str:
    """A splitter's (tokens, chunks) as arrays, or what is wrong with its result."""
    if not isinstance(result, dict):
        return f"it returned a {type(result).__name__}, not a dict with {list(strategy.returns)}"
    missing = [key for key in strategy.returns if key not in result]
    if missing:
        return f"its result lacks {missing}"
    try:
        tokens, chunks = np.asarray(result["tokens"]), np.asarray(result["chunks"])
    except ValueError as err:
        return f"tokens or chunks are not arrays ({err})"
    if tokens.ndim != 1 or chunks.ndim != 1 or not all(
            a.dtype.kind in "iu" for a in (tokens, chunks) if len(a)):
        return "tokens and chunks must be 1-D sequences of integers"
    if len(tokens) and not 0 <= tokens.min() <= tokens.max() < strategy.vocab_size:
        return f"a token id is outside the vocabulary 0..{strategy.vocab_size - 1}"
    if len(chunks) and not 1 <= chunks.min() <= chunks.max() <= strategy.chunk_size:
        return f"a chunk length is outside 1..{strategy.chunk_size}"
    if chunks.sum() != len(tokens):
        return f"chunk lengths sum to {chunks.sum()}, not to the {len(tokens)} tokens"
    return tokens, chunks


def _build_tokenizer(strategy: Strategy, tokenizer_file: Path | None) -> Any:
    try:
        types = registry.variants("mdat_tokenizer")
        if strategy.tokenizer_type not in types:
            raise StrategyError(
                f"unknown tokenizer_type {strategy.tokenizer_type!r}; available: "
                f"{', '.join(types)}."
            )
        return registry.create("mdat_tokenizer", strategy.tokenizer_type, tokenizer_file)
    except RegistryError as err:
        raise StrategyError(
            f"tokenizer {strategy.tokenizer_type!r} cannot run here: {err}"
        ) from err


def _build_splitter(strategy: Strategy, tokenizer: Any, functions: Path) -> Any:
    known = registry.variants("splitter")
    if strategy.splitter_class not in known:
        raise UnknownSplitter(
            f"unknown splitter_class {strategy.splitter_class!r}; available: "
            f"{', '.join(known)}. A custom splitter is a .py file in {functions} that "
            f"registers it with @registry.register('splitter', <name>, 'default')."
        )
    cls = registry.get("splitter", strategy.splitter_class)
    try:
        return cls(tokenizer=tokenizer, chunk_size=strategy.chunk_size,
                   **(strategy.splitter_init or {}))
    except TypeError as err:
        raise StrategyError(
            f"splitter_init {strategy.splitter_init} does not fit splitter "
            f"{strategy.splitter_class!r}: {err}."
        ) from err
