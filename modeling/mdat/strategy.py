"""Pretokenization strategies: the JSON that says how documents become tokens and chunks.

The fields follow the MDAT design (``strategy_name``, ``tokenizer_type``, ``splitter_class``,
``chunk_size``, ...), declared with `modeling.settings.setting`: `Strategy.from_dict` checks
names, types, ranges and choices of the plain data (``strategy_schema()`` says as much for
editors); building the tokenizer and splitter (`modeling.mdat.document_splitter`) checks that
they exist.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from matformer.modeling.errors import ConfigError, InvalidName, SettingsError, StrategyError
from matformer.modeling.settings import read_table, section_schema, setting

if TYPE_CHECKING:
    from matformer.modeling.config import ModelConfig

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
DOCUMENT_FIELDS = ("data", "meta")  # what a splitter may ask for in wants_from_db
DATABASES = ("tokens", "chunks")  # what pretokenization stores, and sequences are built from
# What a splitter of instruction data returns besides: 1 where a token is a response token
# (a loss target), 0 where it is prompt. Pretokenization stores it when ``returns`` lists it.
LOSS_MASK = "loss_mask"


def check_name(kind: str, name: object) -> str:
    """``name`` when it can serve as a folder name, else `InvalidName`."""
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise InvalidName(
            f"{kind} name {name!r} is not allowed; use 1-128 letters, digits, '_', '-' or "
            "'.', starting with a letter or digit."
        )
    return name


@dataclass(frozen=True, slots=True)
class Strategy:
    """How documents become tokens and chunks (a pretokenization strategy)."""

    strategy_name: str = setting(help="its name, a folder name in the container")
    chunk_size: int = setting(low=1, help=(
        "tokens per chunk at most; sequence lengths are multiples of it"))
    tokenizer_type: str = setting("bytes", help="an \"mdat_tokenizer\" registry variant")
    tokenizer_name: str | None = setting(None, help=(
        "huggingface: a tokenizer.json, a folder holding one, or a hub repo id (org/name)"))
    tokenizer_sha256: str | None = setting(None, help=(
        "of that file; filled in when the strategy is added"))
    tokenizer_revision: str | None = setting(None, help=(
        "of a hub repo tokenizer_name (null: main)"))
    vocab_size: int | None = setting(None, low=1, help="null: the tokenizer's own")
    # Special ids; null: the tokenizer's own, if its file names one. Sequences never hold
    # them: consumers add them where they want them (see `modeling.mdat.sequences`).
    bos_token_id: int | None = setting(None, help="the beginning-of-sequence id")
    eos_token_id: int | None = setting(None, help="the end-of-sequence id")
    mask_token_id: int | None = setting(None, help="the mask id (masked objective)")
    splitter_class: str = setting("fixed_chunks", help="a \"splitter\" registry variant")
    splitter_init: dict[str, Any] | None = setting(None, help=(
        "keyword arguments of the splitter's constructor"))
    splitter_arguments: dict[str, Any] | None = setting(None, help=(
        "keyword arguments of every splitter call"))
    modality: str = setting("text", choices=("text",), help="what the documents are")
    wants_from_db: tuple[str, ...] = setting(("data",), help=(
        f"document fields the splitter receives, of {', '.join(DOCUMENT_FIELDS)}"))
    wants_raw: bool = setting(True, help="true: \"data\" is the text; false: its UTF-8 bytes")
    returns: tuple[str, ...] = setting(DATABASES, help="the keys of the splitter's result")
    # Always ("tokens", "chunks"), the results pretokenize stores of every strategy (and
    # LOSS_MASK where ``returns`` lists it); the field stays so that strategy JSON files of
    # the MDAT design load unchanged, and is checked to be that.
    required_databases: tuple[str, ...] = setting(DATABASES, help=(
        f"always {', '.join(DATABASES)}: what pretokenization stores"))

    @property
    def name(self) -> str:
        return self.strategy_name

    @property
    def loss_masked(self) -> bool:
        """Whether its splitter says which tokens are responses (instruction data)."""
        return LOSS_MASK in self.returns

    @property
    def token_dtype(self) -> np.dtype:
        """uint16 when every id fits (vocab_size <= 65,536), else uint32."""
        return np.dtype(np.uint16 if (self.vocab_size or 0) <= 1 << 16 else np.uint32)

    @classmethod
    def from_dict(cls, definition: dict[str, Any]) -> Strategy:
        try:
            strategy = read_table(cls, definition, "strategy", Path())  # no paths
        except SettingsError as err:  # StrategyError is what users of strategies catch
            raise StrategyError(str(err)) from None
        strategy._check_values()
        return strategy

    @classmethod
    def from_file(cls, path: Path) -> Strategy:
        try:
            definition = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise StrategyError(f"cannot read strategy file {path}: {err}") from err
        if not isinstance(definition, dict):
            raise StrategyError(f"strategy file {path} must hold one JSON object.")
        return cls.from_dict(definition)

    def fit_vocabulary(self, config: ModelConfig, *, named: bool) -> ModelConfig:
        """``config`` with room for every id this strategy gives: with this strategy's
        vocabulary when the run did not name its model (``named``), else as named, if its
        vocabulary is large enough (ConfigError naming both sizes if not)."""
        ids = self.vocab_size
        if ids is None or ids == config.vocab_size or (named and ids < config.vocab_size):
            return config
        if named:
            raise ConfigError(
                f"strategy {self.name!r} gives token ids up to {ids - 1:,} (a vocabulary of "
                f"{ids:,}), but the model's vocab_size is {config.vocab_size:,}; raise the "
                "model's vocab_size to at least that, or name no model to take the "
                "strategy's.")
        return dataclasses.replace(config, vocab_size=ids)

    def special_tokens(self) -> dict[str, int | None]:
        return {"bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                "mask_token_id": self.mask_token_id}

    def to_dict(self) -> dict[str, Any]:
        return {key: list(value) if isinstance(value, tuple) else value
                for key, value in asdict(self).items()}

    def _check_values(self) -> None:
        check_name("strategy", self.strategy_name)
        problems = []
        if not set(self.wants_from_db) <= set(DOCUMENT_FIELDS):
            problems.append(f"wants_from_db may hold {list(DOCUMENT_FIELDS)}, got "
                            f"{list(self.wants_from_db)}")
        if set(self.required_databases) != set(DATABASES):
            problems.append(f"required_databases must be {list(DATABASES)}, got "
                            f"{list(self.required_databases)}")
        if not set(self.required_databases) <= set(self.returns):
            problems.append(f"returns {list(self.returns)} must include every required database")
        if problems:
            raise StrategyError(f"strategy {self.strategy_name!r}: {'; '.join(problems)}.")


def strategy_schema() -> dict[str, Any]:
    """The JSON schema (draft 2020-12) of a strategy JSON file."""
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "strategy",
              **section_schema(Strategy)}
    for key in fields(Strategy):
        if key.default is None:  # JSON writes a key not given as null
            schema["properties"][key.name]["type"] = [
                schema["properties"][key.name]["type"], "null"]
    return schema
