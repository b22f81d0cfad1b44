"""Settings files declared once: run.toml, train.toml and a pretokenization strategy.

A section is a ``@dataclass(kw_only=True, slots=True)`` whose fields are its keys, each
declared with ``setting``. From that one declaration come the reading of a table, the checks
of a section built in code, plain data that reads back equal, a JSON schema and flags::

    @dataclass(kw_only=True, slots=True)
    class CheckpointSection:
        every_rounds: int = setting(10, low=1, help="a checkpoint after every this many rounds")

    read_table(CheckpointSection, {"every_rounds": 0}, "checkpoint", base)
    # InvalidValue: [checkpoint] every_rounds must be >= 1, got 0.
    check_declared(CheckpointSection(every_rounds=0), "checkpoint")  # the same error
    table_of(section)                       # -> {"every_rounds": 10}
    json_schema({"checkpoint": CheckpointSection}, title="run.toml")
    add_flags(parser, CheckpointSection)    # --every-rounds N (default: 10)
    given_flags(args, CheckpointSection)    # -> the keys given on the command line
    read_toml(path)                         # the file parsed, or an error naming it

An integer is accepted as a float, a bool is not an integer; a ``Path`` is relative to the
file's folder; floats are finite and integers fit TOML's 64 bits. Checks that need two keys
stay in the section's ``__post_init__``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import tomllib
import types
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from matformer.modeling.errors import (
    InvalidToml,
    InvalidValue,
    MatformerError,
    MissingKey,
    SettingsError,
    UnknownKey,
    WrongType,
    did_you_mean,
)

T = TypeVar("T")
INT64 = (-(2**63), 2**63 - 1)  # TOML's integers: every wire field and seed holds these
_MISSING: Any = dataclasses.MISSING


class FolderOrRepo(str):
    """A checkpoint's source: a local folder (absolute, resolved against the TOML's folder)
    or a Hugging Face hub repository id (``org/name``, where no such folder is)."""

    @property
    def is_repo(self) -> bool:
        return not Path(self).is_absolute()


def setting(default: Any = _MISSING, *, help: str = "", low: float | None = None,
            high: float | None = None, above: bool = False, unit: str = "",
            choices: Iterable[str] | Callable[[], Iterable[str]] | None = None,
            secret: bool = False, flag: str | None = None) -> Any:
    """A key of a section: ``default`` (absent: required; a list or dict is copied per
    instance), the range ``low <= value <= high`` (``low < value`` when ``above``; None: open),
    ``choices`` (or a function giving them, for registries filled later; a mapping of each to
    what it means, as strings, has an invalid value's error explain them), ``help`` for the
    schema and ``--help``, ``secret`` (never shown, in errors or the repr) and ``flag``: the
    option that sets it (None: ``--key-name``; "": none)."""
    metadata = {"help": help, "low": low, "high": high, "above": above, "unit": unit,
                "choices": choices, "secret": secret, "flag": flag}
    if isinstance(default, list | dict):
        return dataclasses.field(default_factory=lambda: type(default)(default),
                                 repr=not secret, metadata=metadata)
    return dataclasses.field(default=default, repr=not secret, metadata=metadata)


def reject_unknown(where: str, given: Iterable[str], valid: list[str]) -> None:
    """UnknownKey for the first key of ``given`` not in ``valid``, with a did-you-mean."""
    for key in given:
        if key not in valid:
            raise UnknownKey(f"{where} has no key {key!r}; {did_you_mean(key, valid)}valid "
                             f"keys: {', '.join(valid)}.")


def read_toml(path: Path) -> dict[str, Any]:
    """The parsed TOML file at ``path``, or an error naming it and what is wrong."""
    try:
        return tomllib.loads(path.read_text())
    except OSError as err:
        raise SettingsError(f"cannot read {path}: {err.strerror or err}; check the path.") \
            from None
    except tomllib.TOMLDecodeError as err:
        raise InvalidToml(f"{path} is not valid TOML: {err}; fix it there.") from None


def read_table(cls: type[T], table: Any, section: str, base: Path) -> T:
    """An instance of the dataclass ``cls`` from the TOML table of ``[section]``."""
    if not isinstance(table, dict):
        raise WrongType(f"[{section}] must be a table, got {_shown(table)}.")
    fields = _keys(cls)
    reject_unknown(f"[{section}]", table, [f.name for f in fields])
    hints, values = get_type_hints(cls), {}
    for f in fields:
        if f.name in table:
            secret = f.metadata.get("secret", False)
            value = _coerce(f"{section}.{f.name}", table[f.name], hints[f.name], base, secret)
            _check(section, f, value)  # before __post_init__, whose checks assume the ranges
            values[f.name] = value
        elif default_of(f) is _MISSING:
            raise MissingKey(f"[{section}] is missing the required key {f.name!r}; add it.")
    try:
        return cls(**values)
    except SettingsError:
        raise
    except MatformerError as err:  # the checks of a modeling config (CompressionConfig)
        raise InvalidValue(f"[{section}] {err}") from err


def check_declared(instance: Any, section: str) -> None:
    """The declared choices and ranges of every key of ``instance``, as ``read_table`` checks
    them: for a section built in code."""
    for f in _keys(type(instance)):
        _check(section, f, getattr(instance, f.name))


def table_of(section: Any) -> dict[str, Any]:
    """Plain data (TOML and JSON types) for a section: None values left out, paths as
    strings, integer dict keys as strings."""
    return {f.name: _plain(getattr(section, f.name)) for f in _keys(type(section))
            if getattr(section, f.name) is not None}


def choices_of(metadata: Mapping[str, Any]) -> list[str] | None:
    choices = metadata.get("choices")
    return list(choices() if callable(choices) else choices) if choices is not None else None


def default_of(f: dataclasses.Field) -> Any:
    """The default of the key ``f`` (a fresh copy of a list), or ``MISSING``: required."""
    return f.default_factory() if f.default_factory is not _MISSING else f.default


def _keys(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init]


def _check(section: str, f: dataclasses.Field, value: Any) -> None:
    """The declared choices and range of the key ``f``, on its value (None: not given)."""
    if value is None:
        return
    where, metadata = f"[{section}] {f.name}", f.metadata
    choices = choices_of(metadata)
    if choices is not None and value not in choices:
        raise InvalidValue(f"{where} {value!r} is not one of {', '.join(map(str, choices))}; "
                           f"{did_you_mean(str(value), map(str, choices))}choose one"
                           f"{_meanings(metadata['choices'])}.")
    low, high, above = metadata.get("low"), metadata.get("high"), metadata.get("above")
    if (low is None or (low < value if above else low <= value)) and \
            (high is None or value <= high):
        return
    if high is None:
        bound = f"be {'>' if above else '>='} {low}"
    elif low is None:
        bound = f"be <= {high}"
    else:
        bound = f"lie in {'(' if above else '['}{low}, {high}]"
    got = "another value" if metadata.get("secret") else value
    raise InvalidValue(f"{where} must {bound}{metadata.get('unit', '')}, got {got}.")


def _meanings(choices: Any) -> str:
    """`` (a: what a means; b: ...)`` for choices declared as a mapping of each to its
    meaning; "" for others (a registry maps names to objects)."""
    if isinstance(choices, Mapping) and all(isinstance(m, str) for m in choices.values()):
        return f" ({'; '.join(f'{c}: {m}' for c, m in choices.items())})"
    return ""


def _plain(value: Any) -> Any:
    if isinstance(value, Path | FolderOrRepo):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _unwrap(hint: Any) -> tuple[Any, bool]:
    """``X`` of ``X | None`` (TOML has no null: an optional key is one left out), and whether
    ``hint`` was optional."""
    if get_origin(hint) in (Union, types.UnionType):
        (inner,) = [a for a in get_args(hint) if a is not type(None)]
        return inner, True
    return hint, False


def _coerce(where: str, value: Any, hint: Any, base: Path, secret: bool) -> Any:
    hint, optional = _unwrap(hint)
    if value is None and optional:
        return None
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any:
        return value
    if hint in (Path, FolderOrRepo):
        kind = "a path (string)" if hint is Path else "a folder or a hub id (string)"
        _expect(isinstance(value, str | Path), where, kind, value, secret)
        folder = (base / Path(value).expanduser()).resolve()
        if hint is Path:
            return folder
        from matformer.modeling.checkpoint.repository import (
            is_repo_id,  # the checkpoint package is big
        )

        repo = not folder.exists() and is_repo_id(str(value)) and not Path(value).is_absolute()
        return FolderOrRepo(value if repo else folder)
    if hint is float:
        _expect(isinstance(value, int | float) and not isinstance(value, bool), where,
                "a number", value, secret)
        if isinstance(value, int):
            return float(_int64(where, value))
        if not math.isfinite(value):
            raise InvalidValue(f"{where} must be a finite number, got {value}.")
        return value
    if hint in (int, str, bool):
        ok = isinstance(value, hint) and (hint is bool or not isinstance(value, bool))
        _expect(ok, where, f"{'an' if hint is int else 'a'} {hint.__name__}", value, secret)
        return _int64(where, value) if hint is int else value
    if origin in (list, tuple):
        _expect(isinstance(value, list | tuple), where, "a list", value, secret)
        items = [_coerce(f"{where}[{i}]", v, args[0], base, secret) for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
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


# --- JSON schema --------------------------------------------------------------------------


def json_schema(sections: Mapping[str, type], *, title: str, description: str = "",
                required: Iterable[str] = ()) -> dict[str, Any]:
    """A JSON schema (draft 2020-12) of a file made of ``sections``; ``required`` names the
    sections it must have."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": title,
            "description": description, "type": "object", "additionalProperties": False,
            "required": list(required),
            "properties": {name: section_schema(cls) for name, cls in sections.items()}}


def section_schema(cls: type) -> dict[str, Any]:
    """The schema of one section: an object of exactly its keys."""
    hints, fields = get_type_hints(cls), _keys(cls)
    schema: dict[str, Any] = {
        "type": "object", "additionalProperties": False,
        "properties": {f.name: _field_schema(f, hints[f.name]) for f in fields},
        "required": [f.name for f in fields if default_of(f) is _MISSING]}
    if cls.__doc__ and not cls.__doc__.startswith(f"{cls.__name__}("):  # dataclass's own
        schema["description"] = " ".join(cls.__doc__.split())
    return schema


def _field_schema(f: dataclasses.Field, hint: Any) -> dict[str, Any]:
    schema = _type_schema(hint)
    meta = f.metadata
    if meta.get("help"):
        schema["description"] = meta["help"]
    if (choices := choices_of(meta)) is not None:
        schema["enum"] = choices
    if meta.get("low") is not None:
        schema["exclusiveMinimum" if meta.get("above") else "minimum"] = meta["low"]
    if meta.get("high") is not None:
        schema["maximum"] = meta["high"]
    if (default := default_of(f)) not in (_MISSING, None) and not meta.get("secret"):
        schema["default"] = _plain(default)
    return schema


def _type_schema(hint: Any) -> dict[str, Any]:
    hint = _unwrap(hint)[0]
    origin, args = get_origin(hint), get_args(hint)
    if hint is bool:
        return {"type": "boolean"}
    if hint is int:
        return {"type": "integer", "minimum": INT64[0], "maximum": INT64[1]}
    if hint is float:
        return {"type": "number"}
    if hint in (str, Path, FolderOrRepo):
        return {"type": "string"}
    if origin in (list, tuple):
        return {"type": "array", "items": _type_schema(args[0])}
    if origin is dict:
        values = _type_schema(args[1])
        if args[0] is int:
            return {"type": "object", "patternProperties": {"^[0-9]+$": values},
                    "additionalProperties": False}
        return {"type": "object", "additionalProperties": values}
    return {}  # Any


# --- command-line flags -------------------------------------------------------------------


def flag_of(f: dataclasses.Field) -> str | None:
    """The option that sets the key ``f`` (None: the key has none)."""
    flag = f.metadata.get("flag")
    return f"--{f.name.replace('_', '-')}" if flag is None else (flag or None)


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """One option per key of the section ``cls``, its help and default from the declaration.
    Every option defaults to None (not given), so ``given_flags`` can tell what the command
    line set; a bool key gets ``--key`` and ``--no-key``."""
    hints = get_type_hints(cls)
    for f in _keys(cls):
        if (flag := flag_of(f)) is None:
            continue
        hint = _unwrap(hints[f.name])[0]
        default = default_of(f)
        shown = "required" if default is _MISSING else f"default: {_flag_text(default)}"
        if (choices := choices_of(f.metadata)) is not None:
            shown = f"one of {', '.join(map(str, choices))}; {shown}"
        kwargs: dict[str, Any] = {"default": None, "dest": f.name,
                                  "help": f"{f.metadata.get('help', '')} ({shown})".strip()}
        if hint is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _parse_flag(hint)
            kwargs["metavar"] = f.name.upper()
        parser.add_argument(flag, **kwargs)


def given_flags(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The keys of ``cls`` the command line gave, as a table ``read_table`` reads (relative
    paths made absolute: a flag's path is relative to the working directory)."""
    given, hints = {}, get_type_hints(cls)
    for f in _keys(cls):
        if flag_of(f) is not None and getattr(args, f.name, None) is not None:
            value, hint = getattr(args, f.name), _unwrap(hints[f.name])[0]
            if hint in (Path, FolderOrRepo):  # a folder here, or (FolderOrRepo) a hub id
                value = str(_coerce(flag_of(f), value, hint, Path.cwd(), False))
            given[f.name] = value
    return given


def _flag_text(value: Any) -> str:
    """A default as the flag would be written (None: "not set")."""
    if value is None:
        return "not set"
    if isinstance(value, list | tuple):
        return ",".join(map(str, value))
    return str(_plain(value))


def _parse_flag(hint: Any) -> Callable[[str], Any]:
    """A flag's text into the value its key takes (a list: comma-separated)."""
    if get_origin(hint) in (list, tuple):
        item = _parse_flag(get_args(hint)[0])

        def items(text: str) -> list[Any]:
            return [item(part) for part in text.split(",") if part.strip()]

        items.__name__ = "comma-separated list"
        return items
    if hint in (int, float, Path):
        return hint
    return str
