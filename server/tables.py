"""One TOML table into one typed config dataclass, and back.

Every section of run.toml is a ``@dataclass(kw_only=True, slots=True)``. ``read_table``
checks a table against the fields before the dataclass's own checks run: unknown keys (named
with the valid ones and the closest match), missing required keys, and types (an integer is
accepted as a float, a bool is not an integer; a ``Path`` is a string relative to the folder
of the TOML file, a ``FolderOrRepo`` such a path or a Hugging Face hub id), and the range
every number keeps whatever its key: floats are finite (TOML can write ``inf`` and ``nan``),
integers fit TOML's 64 bits (``tomllib`` reads any size). ``table_of`` turns a section back
into plain data that ``read_table`` reads to an equal section.

A field with ``metadata={"secret": True}`` never has its value quoted in an error.
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from modeling.checkpoint.repository import is_repo_id
from modeling.errors import MatformerError, did_you_mean
from server.errors import InvalidValue, MissingKey, ServerConfigError, UnknownKey, WrongType

T = TypeVar("T")
INT64 = (-(2**63), 2**63 - 1)  # TOML's integers: every wire field and seed holds these


class FolderOrRepo(str):
    """A checkpoint's source: a local folder (absolute, resolved against the TOML's folder)
    or a Hugging Face hub repository id (``org/name``, where no such folder is)."""

    @property
    def is_repo(self) -> bool:
        return not Path(self).is_absolute()


def reject_unknown(where: str, given: Iterable[str], valid: list[str]) -> None:
    """UnknownKey for the first key of ``given`` not in ``valid``, with a did-you-mean."""
    for key in given:
        if key not in valid:
            raise UnknownKey(f"{where} has no key {key!r}; {did_you_mean(key, valid)}valid "
                             f"keys: {', '.join(valid)}.")


def read_table(cls: type[T], table: Any, section: str, base: Path) -> T:
    """An instance of the dataclass ``cls`` from the TOML table of ``[section]``."""
    if not isinstance(table, dict):
        raise WrongType(f"[{section}] must be a table, got {_shown(table)}.")
    fields = [f for f in dataclasses.fields(cls) if f.init]
    reject_unknown(f"[{section}]", table, [f.name for f in fields])
    hints = get_type_hints(cls)
    values = {}
    for f in fields:
        if f.name in table:
            secret = f.metadata.get("secret", False)
            values[f.name] = _coerce(f"{section}.{f.name}", table[f.name], hints[f.name], base,
                                     secret)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise MissingKey(f"[{section}] is missing the required key {f.name!r}; add it.")
    try:
        return cls(**values)
    except ServerConfigError:
        raise
    except MatformerError as err:  # the checks of a modeling config (CompressionConfig)
        raise InvalidValue(f"[{section}] {err}") from err


def table_of(section: Any) -> dict[str, Any]:
    """Plain data (TOML and JSON types) for a section: None values left out, paths as
    strings, integer dict keys as strings."""
    return {
        f.name: _plain(getattr(section, f.name))
        for f in dataclasses.fields(section)
        if f.init and getattr(section, f.name) is not None
    }


def _plain(value: Any) -> Any:
    if isinstance(value, Path | FolderOrRepo):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _coerce(where: str, value: Any, hint: Any, base: Path, secret: bool) -> Any:
    origin, args = get_origin(hint), get_args(hint)
    if origin in (Union, types.UnionType):  # X | None
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(where, value, inner, base, secret)
    if hint is Any:
        return value
    if hint is Path:
        _expect(isinstance(value, str | Path), where, "a path (string)", value, secret)
        return (base / Path(value).expanduser()).resolve()
    if hint is FolderOrRepo:
        _expect(isinstance(value, str | Path), where, "a folder or a hub id (string)", value,
                secret)
        folder = (base / Path(value).expanduser()).resolve()
        repo = not folder.exists() and is_repo_id(str(value)) and not Path(value).is_absolute()
        return FolderOrRepo(value if repo else folder)
    if hint is float:
        _expect(isinstance(value, int | float) and not isinstance(value, bool), where,
                "a number", value, secret)
        if isinstance(value, int):
            return float(_int64(where, value))
        if not math.isfinite(value):
            raise InvalidValue(f"{where} must be a finite number, got {value}; "
                               "examples/run.toml shows each key's range.")
        return value
    if hint in (int, str, bool):
        ok = isinstance(value, hint) and (hint is bool or not isinstance(value, bool))
        _expect(ok, where, f"{'an' if hint is int else 'a'} {hint.__name__}", value, secret)
        return _int64(where, value) if hint is int else value
    if origin is list:
        _expect(isinstance(value, list), where, "a list", value, secret)
        return [_coerce(f"{where}[{i}]", v, args[0], base, secret) for i, v in enumerate(value)]
    if origin is dict:
        _expect(isinstance(value, dict), where, "a table", value, secret)
        return {_key(where, k, args[0]): _coerce(f"{where}.{k}", v, args[1], base, secret)
                for k, v in value.items()}
    raise TypeError(f"{where}: no reader for the annotation {hint!r}")  # a bug, not user input


def _int64(where: str, value: int) -> int:
    if not INT64[0] <= value <= INT64[1]:
        raise InvalidValue(f"{where} must lie in [{INT64[0]}, {INT64[1]}] (TOML's 64-bit "
                           f"integers), got {value}.")
    return value


def _key(where: str, key: Any, hint: Any) -> Any:
    if hint is int and isinstance(key, str):  # TOML keys are strings: "1" names tier 1
        if not key.isdigit():
            raise WrongType(f"[{where}] keys are tier numbers such as \"1\", got {key!r}.")
        return int(key)
    return key


def _expect(ok: bool, where: str, kind: str, value: Any, secret: bool) -> None:
    if not ok:
        got = f"a {type(value).__name__}" if secret else _shown(value)
        raise WrongType(f"{where} must be {kind}, got {got}.")


def _shown(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"
