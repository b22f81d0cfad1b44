"""Tokenizers an MDAT strategy can name (``tokenizer_type``), as registry entries of
``mdat_tokenizer``, and the one place a strategy's tokenizer is built from them.

A splitter needs token ids and, to align chunks with sentences, the character at which each
token starts. Both implementations give the two from one call. A new tokenizer type is a new
``@registry.register("mdat_tokenizer", <type>, <name>)`` class, in this package or in the
container's ``functions/`` folder.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from matformer.modeling.errors import RegistryError, StrategyError, TokenizerNotFound
from matformer.modeling.registry import registry
from matformer.modeling.tokenizers.byte_level import ByteTokenizer


class TextTokenizer(Protocol):
    vocab_size: int
    bos_token_id: int | None
    eos_token_id: int | None
    mask_token_id: int | None

    def encode(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """Token ids, and the index of the character each token starts at (both (n,))."""
        ...

    def decode(self, ids: list[int]) -> str:
        """The text of ``ids`` (what a model generated), special tokens left out."""
        ...


@registry.register("mdat_tokenizer", "bytes", "default")
class BytesTokenizer:
    """`ByteTokenizer`'s ids: one token per UTF-8 byte, needs no file."""

    vocab_size = ByteTokenizer.vocab_size
    bos_token_id = ByteTokenizer.bos_token_id
    eos_token_id = ByteTokenizer.eos_token_id
    mask_token_id = ByteTokenizer.mask_token_id

    def __init__(self, tokenizer_file: Path | None = None) -> None:
        del tokenizer_file  # the byte vocabulary needs none

    def encode(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
        # Every byte but a UTF-8 continuation byte (0b10xxxxxx) starts a new character.
        starts = np.cumsum((ids & 0xC0) != 0x80) - 1
        return ids, starts

    def decode(self, ids: list[int]) -> str:
        return ByteTokenizer().decode(ids)


# How common tokenizers spell their special tokens, by strategy field; `train_tokenizer`
# writes the first of each. A tokenizer.json's special tokens are matched in this order.
SPECIAL_TOKEN_NAMES = {
    "bos_token_id": ("<bos>", "<s>", "[BOS]", "<|begin_of_text|>", "<|startoftext|>"),
    "eos_token_id": ("<eos>", "</s>", "[EOS]", "<|end_of_text|>", "<|endoftext|>"),
    "mask_token_id": ("<mask>", "[MASK]"),
}


# Files beside a tokenizer.json that give its chat template, as transformers names them (the
# second wins); a strategy keeps a copy of them with its tokenizer.json.
CHAT_TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja")
# tokenizer_config.json's special tokens, which a chat template reads by these names
_TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                    "cls_token", "mask_token")


@registry.register("mdat_tokenizer", "huggingface", "default", requires=["tokenizers"])
class HuggingFaceTokenizer:
    """A ``tokenizers`` ``tokenizer.json`` read from a local file; special tokens not added.

    Its bos, eos and mask ids are those of the file's special tokens named as in
    `SPECIAL_TOKEN_NAMES`, or None. Its ``chat_template`` (or None) and the spellings of the
    special tokens that template reads (``template_tokens``) come from the
    `CHAT_TEMPLATE_FILES` beside the file, where there are any.
    """

    def __init__(self, tokenizer_file: Path | None = None) -> None:
        from tokenizers import Tokenizer

        if tokenizer_file is None or not Path(tokenizer_file).is_file():
            raise TokenizerNotFound(
                f"tokenizer file {tokenizer_file} does not exist; set tokenizer_name to the "
                "path of a local tokenizer.json (train one with `matformer-mdat train-tokenizer`)."
            )
        try:
            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as err:  # the tokenizers library raises plain Exception
            raise StrategyError(
                f"tokenizer file {tokenizer_file} is not a tokenizer.json the tokenizers "
                f"library can load ({err}); point tokenizer_name at a valid one (train one "
                "with `matformer-mdat train-tokenizer`)."
            ) from err
        self.vocab_size = self._tokenizer.get_vocab_size()
        specials = {token.content: index for index, token
                    in self._tokenizer.get_added_tokens_decoder().items() if token.special}
        found = {field: next((specials[name] for name in names if name in specials), None)
                 for field, names in SPECIAL_TOKEN_NAMES.items()}
        self.bos_token_id: int | None = found["bos_token_id"]
        self.eos_token_id: int | None = found["eos_token_id"]
        self.mask_token_id: int | None = found["mask_token_id"]
        self.chat_template, self.template_tokens = _chat_template(Path(tokenizer_file).parent)

    def encode(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        encoding = self._tokenizer.encode(text, add_special_tokens=False)
        starts = np.array([start for start, _ in encoding.offsets], dtype=np.int64)
        return np.array(encoding.ids, dtype=np.int64), starts

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)


def _chat_template(folder: Path) -> tuple[str | None, dict[str, str]]:
    """(the chat template, the special tokens' spellings by name) the `CHAT_TEMPLATE_FILES`
    in ``folder`` give; (None, {}) where there are none."""
    config_file, template_file = (folder / name for name in CHAT_TEMPLATE_FILES)
    try:
        config = json.loads(config_file.read_text(encoding="utf-8")) \
            if config_file.is_file() else {}
    except ValueError as err:
        raise StrategyError(f"{config_file} is not JSON ({err}); fix or remove it.") from err
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: transformers uses "default"
        template = next((t.get("template") for t in template if t.get("name") == "default"),
                        None)
    if template_file.is_file():
        template = template_file.read_text(encoding="utf-8")
    spellings = {}
    for name in _TEMPLATE_TOKENS:
        token = config.get(name)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str):
            spellings[name] = token
    return template if isinstance(template, str) else None, spellings


def locate_tokenizer(name: str, revision: str | None = None) -> tuple[Path, str]:
    """(the ``tokenizer.json`` a strategy's ``tokenizer_name`` names, the name to record).

    ``name`` is a local file, a local folder holding ``tokenizer.json`` (a model saved by
    transformers, say), or a hub repo id (``org/name``, at ``revision``) resolved through the
    hub cache: downloaded when missing, read from the cache alone under ``HF_HUB_OFFLINE=1``.
    A local file is recorded by its absolute path, a hub file by its repo id.
    """
    from matformer.modeling.checkpoint.repository import HubRepository, is_repo_id

    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        return path.resolve(), str(path.resolve())
    if not is_repo_id(name):
        raise TokenizerNotFound(
            f"tokenizer file {name} does not exist, and it is no hub repo id ('org/name'); set "
            "tokenizer_name to a tokenizer.json, a folder holding one, or a hub repo id.")
    hub = HubRepository(name, revision)
    try:
        found = hub.fetch("tokenizer.json")
    except Exception as err:  # no network, an unknown repo or revision, a gated repo, ...
        raise TokenizerNotFound(f"tokenizer_name {hub}: tokenizer.json could not be fetched "
                                f"({type(err).__name__}: {err}).") from err
    if found is None:
        raise TokenizerNotFound(
            f"tokenizer_name {hub}: no tokenizer.json there (or, offline, not in the hub "
            "cache); check the repo id and tokenizer_revision, or give a local file.")
    return found, name


def build_text_tokenizer(tokenizer_type: str, tokenizer_file: Path | None) -> Any:
    """The ``mdat_tokenizer`` registered as ``tokenizer_type``, reading ``tokenizer_file``;
    StrategyError names the types there are, or why this one cannot run here."""
    try:
        types = registry.variants("mdat_tokenizer")
        if tokenizer_type not in types:
            raise StrategyError(
                f"unknown tokenizer_type {tokenizer_type!r}; available: {', '.join(types)}."
            )
        return registry.create("mdat_tokenizer", tokenizer_type, tokenizer_file)
    except RegistryError as err:
        raise StrategyError(f"tokenizer {tokenizer_type!r} cannot run here: {err}") from err
