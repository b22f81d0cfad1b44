"""Pretokenization strategies: the JSON that says how documents become tokens and chunks.

The fields follow the MDAT design (``strategy_name``, ``tokenizer_type``, ``splitter_class``,
``chunk_size``, ...). `Strategy.from_dict` checks names and types of the plain data; building
the tokenizer and splitter (`modeling.mdat.document_splitter`) checks that they exist.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from modeling.errors import ConfigError, InvalidName, StrategyError, closest, did_you_mean

if TYPE_CHECKING:
    from modeling.config import ModelConfig

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
DOCUMENT_FIELDS = ("data", "meta")  # what a splitter may ask for in wants_from_db
DATABASES = ("tokens", "chunks")  # what pretokenization stores, and sequences are built from


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
    strategy_name: str
    chunk_size: int  # tokens per chunk at most; sequence lengths are multiples of it
    tokenizer_type: str = "bytes"  # an "mdat_tokenizer" registry variant
    # "huggingface": a tokenizer.json, a folder holding one, or a hub repo id (org/name)
    tokenizer_name: str | None = None
    tokenizer_sha256: str | None = None  # of that file; filled in when the strategy is added
    tokenizer_revision: str | None = None  # of a hub repo tokenizer_name (None: main)
    vocab_size: int | None = None  # None: the tokenizer's own
    # Special ids; None: the tokenizer's own, if its file names one. Sequences never hold
    # them: consumers add them where they want them (see `modeling.mdat.sequences`).
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    mask_token_id: int | None = None
    splitter_class: str = "fixed_chunks"  # a "splitter" registry variant
    splitter_init: dict | None = None  # keyword arguments of the splitter's constructor
    splitter_arguments: dict | None = None  # keyword arguments of every splitter call
    modality: str = "text"
    wants_from_db: tuple[str, ...] = ("data",)  # document fields the splitter receives
    wants_raw: bool = True  # True: "data" is the text (str); False: its UTF-8 bytes
    returns: tuple[str, ...] = ("tokens", "chunks")  # the keys of the splitter's result
    # Always ("tokens", "chunks"), the only results pretokenize stores; the field stays so
    # that strategy JSON files of the MDAT design load unchanged, and is checked to be that.
    required_databases: tuple[str, ...] = DATABASES

    @property
    def name(self) -> str:
        return self.strategy_name

    @property
    def token_dtype(self) -> np.dtype:
        """uint16 when every id fits (vocab_size <= 65,536), else uint32."""
        return np.dtype(np.uint16 if (self.vocab_size or 0) <= 1 << 16 else np.uint32)

    @classmethod
    def from_dict(cls, definition: dict[str, Any]) -> Strategy:
        valid = [spec.name for spec in fields(cls)]
        unknown = [key for key in definition if key not in valid]
        if unknown:
            hints = [f"{key!r} ({did_you_mean(key, valid).strip()})"
                     if closest(key, valid) else repr(key) for key in unknown]
            raise StrategyError(
                f"unknown strategy field {', '.join(hints)}; valid fields: {', '.join(valid)}."
            )
        missing = [key for key in ("strategy_name", "chunk_size") if key not in definition]
        if missing:
            raise StrategyError(f"a strategy needs {' and '.join(missing)}; add it to the JSON.")
        values = {key: _typed_value(key, value) for key, value in definition.items()}
        strategy = cls(**values)
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
        if self.chunk_size <= 0:
            problems.append(f"chunk_size must be positive, got {self.chunk_size}")
        if self.modality != "text":
            problems.append(f"modality {self.modality!r} is not supported (only 'text')")
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


_INT = (int,)
_OPTIONAL_INT = (int, type(None))
_NAMES = (list, tuple)
_TYPES: dict[str, tuple[type, ...]] = {
    "strategy_name": (str,), "chunk_size": _INT, "tokenizer_type": (str,),
    "tokenizer_name": (str, type(None)), "tokenizer_sha256": (str, type(None)),
    "tokenizer_revision": (str, type(None)),
    "vocab_size": _OPTIONAL_INT,
    "bos_token_id": _OPTIONAL_INT, "eos_token_id": _OPTIONAL_INT, "mask_token_id": _OPTIONAL_INT,
    "splitter_class": (str,), "splitter_init": (dict, type(None)),
    "splitter_arguments": (dict, type(None)), "modality": (str,), "wants_from_db": _NAMES,
    "wants_raw": (bool,), "returns": _NAMES, "required_databases": _NAMES,
}


def _typed_value(key: str, value: Any) -> Any:
    """``value`` when it has the type field ``key`` takes (lists become tuples)."""
    expected = _TYPES[key]
    wrong_bool = isinstance(value, bool) and bool not in expected
    if wrong_bool or not isinstance(value, expected):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in expected)
        raise StrategyError(f"strategy field {key!r} must be {names}, got {value!r}.")
    if expected is _NAMES:
        if not all(isinstance(item, str) for item in value):
            raise StrategyError(f"strategy field {key!r} must list strings, got {value!r}.")
        return tuple(value)
    return value
