"""Chat templates: a stored conversation (`modeling.mdat.conversations`) as tokens, with which
of them are responses, the only tokens instruction tuning trains on.

A template renders a conversation as pieces, each a text or a special token's id, and each
prompt or response. Each run of text between two ids is tokenized in one call, so a template
that writes its markers as text tokenizes exactly as its whole rendered text does; a token is
a response token when it starts inside response text. Templates are registry entries of
category ``"chat_template"`` (built as ``cls(tokenizer=...)``); two are built in:

- ``tokenizer``: the tokenizer's own chat template (the Jinja source in the
  ``tokenizer_config.json`` or ``chat_template.jinja`` beside its ``tokenizer.json``),
  rendered as transformers' ``apply_chat_template`` renders it: in the same sandboxed
  environment, with the special tokens of ``tokenizer_config.json`` as variables. The response
  text of an assistant message runs from the end of the conversation before it, rendered with
  the generation prompt, to the end of the conversation up to it: the message and its
  end-of-turn marker. A template that does not render a conversation as the start of its
  continuations cannot be split so, and is refused.
- ``plain``: for a prompt and a response, ``<bos>User: {prompt}\\nAssistant: {response}<eos>``.
  Every message is one line, ``System: ...``, ``User: ...`` or ``Assistant: ...``; an
  assistant's text and the ``<eos>`` after it are its response. ``<bos>`` and ``<eos>`` are
  the tokenizer's ids, not text (left out where it has none), so it suits any tokenizer.

The splitter ``conversation`` renders each document with the template its ``splitter_init``
names (``template``: ``"auto"``, the default, is the tokenizer's where it has one, else
plain), cuts the tokens into chunks of ``chunk_size`` and returns the loss mask: a strategy
that uses it lists ``"loss_mask"`` in ``returns``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol

import numpy as np

from matformer.modeling.errors import RegistryError, StrategyError
from matformer.modeling.mdat.builtin_splitters import document_text, fixed_lengths
from matformer.modeling.mdat.conversations import RESPONSE_ROLE, Messages, conversation
from matformer.modeling.registry import registry
from matformer.modeling.tokenizers import TextTokenizer

Piece = tuple[str | int, bool]  # a text or a special token's id; whether it is response


class ChatTemplate(Protocol):
    def pieces(self, messages: Messages) -> list[Piece]:
        """``messages`` rendered, in order."""
        ...


@registry.register("chat_template", "plain", "default")
class PlainTemplate:
    """``<bos>User: {prompt}\\nAssistant: {response}<eos>``, one line per message."""

    def __init__(self, *, tokenizer: TextTokenizer) -> None:
        self.bos, self.eos = tokenizer.bos_token_id, tokenizer.eos_token_id

    def pieces(self, messages: Messages) -> list[Piece]:
        rendered: list[Piece] = [] if self.bos is None else [(self.bos, False)]
        for number, message in enumerate(messages):
            if number:
                rendered.append(("\n", False))
            role, content = message["role"], message["content"]
            rendered.append((f"{role.capitalize()}: ", False))
            rendered.append((content, role == RESPONSE_ROLE))
            if role == RESPONSE_ROLE and self.eos is not None:
                rendered.append((self.eos, True))
        return rendered


@registry.register("chat_template", "tokenizer", "default", requires=["jinja2"])
class TokenizerTemplate:
    """The tokenizer's own chat template, rendered as transformers renders it."""

    def __init__(self, *, tokenizer: TextTokenizer) -> None:
        source = getattr(tokenizer, "chat_template", None)
        if not source:
            raise StrategyError(
                "the strategy's tokenizer has no chat template (a \"chat_template\" in the "
                "tokenizer_config.json beside its tokenizer.json, or a chat_template.jinja); "
                "give it one, or use splitter_init {\"template\": \"plain\"}.")
        self._render = compile_template(source)
        self._variables = dict(getattr(tokenizer, "template_tokens", {}))

    def render(self, messages: Messages, add_generation_prompt: bool = False) -> str:
        """What ``apply_chat_template(messages, tokenize=False, ...)`` gives."""
        return self._render(messages=messages, tools=None, documents=None,
                            add_generation_prompt=add_generation_prompt, **self._variables)

    def pieces(self, messages: Messages) -> list[Piece]:
        whole = self.render(messages)
        rendered: list[Piece] = []
        done = 0  # characters of ``whole`` in ``rendered``
        for number, message in enumerate(messages):
            if message["role"] != RESPONSE_ROLE:
                continue
            prompt = self.render(messages[:number], add_generation_prompt=True)
            upto = self.render(messages[:number + 1])
            end = _shared_start(upto, whole)
            if not whole.startswith(prompt) or end < len(prompt):
                raise StrategyError(
                    "the tokenizer's chat template does not render a conversation as the "
                    "start of its continuation, so its responses cannot be told apart; use "
                    "splitter_init {\"template\": \"plain\"}.")
            rendered += [(whole[done:len(prompt)], False), (whole[len(prompt):end], True)]
            done = end
        rendered.append((whole[done:], False))
        return rendered


def _shared_start(one: str, other: str) -> int:
    """How many characters ``one`` and ``other`` begin with alike."""
    if other.startswith(one):
        return len(one)
    return next((i for i, (a, b) in enumerate(zip(one, other, strict=False)) if a != b),
                min(len(one), len(other)))


def compile_template(source: str) -> Callable[..., str]:
    """Jinja ``source`` compiled as transformers compiles a chat template: a sandbox that
    trims blocks, ``tojson`` without HTML escapes, ``raise_exception``, ``strftime_now``, loop
    controls, and ``{% generation %}`` blocks (rendered as their content)."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = frozenset({"generation"})

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda form: datetime.now().strftime(form)
    try:
        return environment.from_string(source).render
    except jinja2.TemplateError as err:
        raise StrategyError(f"the tokenizer's chat template is not valid Jinja ({err}).") from err


def encode_pieces(tokenizer: TextTokenizer, pieces: list[Piece]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids (n,), loss mask (n,) uint8: 1 on response tokens) of rendered ``pieces``."""
    ids: list[np.ndarray] = []
    mask: list[np.ndarray] = []
    text: list[str] = []
    spans: list[tuple[int, int]] = []  # response characters of the run in ``text``
    length = 0

    def tokenize_run() -> None:
        nonlocal length
        if text:
            tokens, starts = tokenizer.encode("".join(text))
            inside = np.zeros(len(tokens), dtype=bool)
            for first, end in spans:
                inside |= (starts >= first) & (starts < end)
            ids.append(np.asarray(tokens, dtype=np.int64))
            mask.append(inside)
        text.clear()
        spans.clear()
        length = 0

    for piece, response in pieces:
        if isinstance(piece, str):
            if response:
                spans.append((length, length + len(piece)))
            text.append(piece)
            length += len(piece)
        else:
            tokenize_run()
            ids.append(np.array([piece], dtype=np.int64))
            mask.append(np.array([response]))
    tokenize_run()
    return np.concatenate([np.zeros(0, np.int64), *ids]), \
        np.concatenate([np.zeros(0, bool), *mask]).astype(np.uint8)


@registry.register("splitter", "conversation", "default")
class ConversationChunks:
    """A conversation rendered with a chat template and tokenized; chunks of ``chunk_size``
    (the last may be shorter); the loss mask: its response tokens."""

    def __init__(self, *, tokenizer: TextTokenizer, chunk_size: int,
                 template: str = "auto") -> None:
        self.tokenizer = tokenizer
        self.chunk_size = chunk_size
        if template == "auto":
            template = "tokenizer" if getattr(tokenizer, "chat_template", None) else "plain"
        known = registry.variants("chat_template")
        if template not in known:
            raise StrategyError(f"unknown chat template {template!r}; splitter_init "
                                f"\"template\" may be \"auto\", {', '.join(map(repr, known))}.")
        try:
            self.template: ChatTemplate = registry.create("chat_template", template,
                                                          tokenizer=tokenizer)
        except RegistryError as err:
            raise StrategyError(f"chat template {template!r} cannot run here: {err}") from err

    def __call__(self, document: dict[str, Any]) -> dict[str, Any]:
        pieces = self.template.pieces(conversation(document_text(document)))
        tokens, loss_mask = encode_pieces(self.tokenizer, pieces)
        return {"tokens": tokens, "chunks": fixed_lengths(len(tokens), self.chunk_size),
                "loss_mask": loss_mask}
