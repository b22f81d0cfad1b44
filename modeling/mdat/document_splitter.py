"""A strategy made runnable (``DocumentSplitter``): its tokenizer and splitter built, and their
output checked.

Splitters come from the registry (built-ins in `modeling.mdat.builtin_splitters`, custom
ones from ``.py`` files in the container's ``functions/`` folder, loaded when a strategy is
built, and only with the user's consent: `modeling.trust`). Whatever a splitter returns is
checked before it is stored, so a buggy custom splitter fails on the document that exposed
it instead of corrupting sequences later: the keys must be exactly the strategy's
``returns``. Only ``tokens``, ``chunks`` and, where ``returns`` lists it, ``loss_mask`` (one 0
or 1 per token: instruction data, `modeling.mdat.chat_templates`) are stored; any other key
``returns`` lists is checked to be present, then dropped.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from matformer.modeling.errors import (
    RemoteCodeRefused,
    SplitterError,
    StrategyError,
    UnknownSplitter,
)
from matformer.modeling.mdat import builtin_splitters as _builtin  # noqa: F401  (registers built-ins)
from matformer.modeling.mdat import chat_templates as _chat  # noqa: F401  (registers "conversation")
from matformer.modeling.mdat.strategy import LOSS_MASK, Strategy
from matformer.modeling.registry import registry
from matformer.modeling.tokenizers import build_text_tokenizer
from matformer.modeling.trust import refusal

Split = tuple[np.ndarray, np.ndarray, np.ndarray | None]  # tokens, chunks, loss mask or None


class DocumentSplitter:
    """Turns one document into (tokens, chunk lengths) the way ``strategy`` says."""

    def __init__(self, strategy: Strategy, functions: Path, tokenizer_file: Path | None, *,
                 trust_remote_code: bool = False) -> None:
        """``functions``: the container's folder of custom code, imported only with
        ``trust_remote_code``; without it, the strategy must name registered components."""
        if trust_remote_code:
            registry.load_modules(functions)
        self.strategy = strategy
        self.tokenizer = _refused_without_code(
            lambda: build_text_tokenizer(strategy.tokenizer_type, tokenizer_file),
            functions, trust_remote_code, f"tokenizer_type {strategy.tokenizer_type!r}")
        self._tokenizer_file = tokenizer_file
        self._splitter = _refused_without_code(
            lambda: _build_splitter(strategy, self.tokenizer, functions),
            functions, trust_remote_code, f"splitter_class {strategy.splitter_class!r}")

    def resolved(self) -> Strategy:
        """The strategy with what it left open filled in: the vocabulary size, the special
        ids the tokenizer file names (`modeling.tokenizers.text`) and the tokenizer file's
        sha256."""
        s, tok = self.strategy, self.tokenizer
        if s.vocab_size is not None and s.vocab_size < tok.vocab_size:
            raise StrategyError(
                f"strategy {s.name!r}: vocab_size {s.vocab_size} is smaller than its "
                f"tokenizer's {tok.vocab_size}; raise it or leave it out."
            )
        sha256 = _file_sha256(self._tokenizer_file) if self._tokenizer_file else None
        if s.tokenizer_sha256 not in (None, sha256):
            raise StrategyError(
                f"strategy {s.name!r}: tokenizer file {s.tokenizer_name} has sha256 {sha256}, "
                f"not the {s.tokenizer_sha256} the strategy gives; point it at the right file."
            )
        resolved = replace(
            s, vocab_size=s.vocab_size or tok.vocab_size, tokenizer_sha256=sha256,
            bos_token_id=s.bos_token_id if s.bos_token_id is not None else tok.bos_token_id,
            eos_token_id=s.eos_token_id if s.eos_token_id is not None else tok.eos_token_id,
            mask_token_id=s.mask_token_id if s.mask_token_id is not None else tok.mask_token_id,
        )
        for field, token in resolved.special_tokens().items():
            if token is not None and not 0 <= token < resolved.vocab_size:
                raise StrategyError(
                    f"strategy {s.name!r}: {field} {token} is outside the vocabulary "
                    f"0..{resolved.vocab_size - 1}; give an id inside it, or null for the "
                    "tokenizer's own."
                )
        return resolved

    def split(self, document: dict[str, Any], where: str) -> Split:
        """Token ids (n,), chunk lengths (c,) and, for a strategy of instruction data, the
        loss mask (n,) of ``document``; ``where`` names it in errors."""
        s = self.strategy
        try:
            result = self._splitter(document, **(s.splitter_arguments or {}))
        except Exception as err:
            raise SplitterError(
                f"splitter {s.splitter_class!r} failed on {where}: {err!r}. Fix the splitter; "
                "pretokenize resumes from the last committed batch."
            ) from err
        arrays = _result_arrays(s, result)
        if isinstance(arrays, str):
            raise SplitterError(
                f"splitter {s.splitter_class!r} returned an invalid result for {where}: "
                f"{arrays}. Fix the splitter; nothing of this document was stored."
            )
        return arrays


def _result_arrays(strategy: Strategy, result: Any) -> Split | str:
    """A splitter's (tokens, chunks, loss mask) as arrays, or what is wrong with its result."""
    if not isinstance(result, dict):
        return f"it returned a {type(result).__name__}, not a dict with {list(strategy.returns)}"
    missing = [key for key in strategy.returns if key not in result]
    if missing:
        return f"its result lacks {missing}"
    unlisted = [key for key in result if key not in strategy.returns]
    if unlisted:
        return (f"its result has {unlisted}, which the strategy's returns "
                f"{list(strategy.returns)} does not list; list them or drop them")
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
    if not strategy.loss_masked:
        return tokens, chunks, None
    loss_mask = np.asarray(result[LOSS_MASK])
    if loss_mask.shape != tokens.shape or not np.isin(loss_mask, (0, 1)).all():
        return f"{LOSS_MASK} must hold one 0 or 1 per token ({len(tokens)})"
    return tokens, chunks, loss_mask.astype(np.uint8)


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _refused_without_code(build: Callable[[], Any], functions: Path, trusted: bool,
                          component: str) -> Any:
    """``build()``; where it fails for want of a component that ``functions`` may hold but
    was not allowed to load, the refusal says so instead."""
    try:
        return build()
    except StrategyError:
        code = sorted(p.name for p in functions.glob("*.py")) if functions.is_dir() else []
        if trusted or not code:
            raise
        raise RemoteCodeRefused(refusal(functions, code, f"may register the strategy's "
                                                         f"{component}")) from None


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
