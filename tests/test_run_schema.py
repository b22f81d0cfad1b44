"""run.toml's JSON schema (``server.config.run_schema``) and the declarations it comes from:
the schema takes every run.toml the repo ships, it and RunConfig refuse the same typos and
out-of-range numbers, RunConfig's errors name the key, its range and a did-you-mean, and each
bound the schema states is the one RunConfig keeps."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator
from support.helpers import CHECKED_MODEL, checked_tables, write_run_toml

from matformer.server.config import RunConfig, run_schema
from matformer.server.errors import InvalidValue, ServerConfigError, UnknownKey

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").rglob("run.toml"))
SCHEMA = run_schema()
VALIDATOR = Draft202012Validator(SCHEMA)


def keys_of(section: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The keys of a section's schema (``auth`` is also a mode alone: its table's keys)."""
    table = next(s for s in section.get("anyOf", [section]) if s.get("type") == "object")
    return table["properties"]


KEYS = [(name, key, prop) for name, section in SCHEMA["properties"].items()
        for key, prop in keys_of(section).items()]
# (section, key, the bound's schema keyword, the bound): every bound the schema states
BOUNDS = [(name, key, word, prop[word]) for name, key, prop in KEYS
          for word in ("minimum", "exclusiveMinimum", "maximum") if word in prop]
# Every name of a key, to tell a check across keys (its message names the other one) apart
NAMES = {key for _, key, _ in KEYS} | set(CHECKED_MODEL)


def with_key(section: str, key: str, value: Any) -> dict[str, Any]:
    tables = checked_tables()
    tables[section] = {**tables.get(section, {}), key: value}
    return tables


def step(prop: dict[str, Any], bound: float, direction: float) -> float:
    """The value next to ``bound`` towards ``direction``: an integer or float as the key takes."""
    if prop["type"] == "integer":
        return int(bound + direction)
    return math.nextafter(float(bound), direction * math.inf)


def test_the_schema_is_a_json_schema_that_takes_every_shipped_run_toml():
    Draft202012Validator.check_schema(json.loads(json.dumps(SCHEMA)))
    assert EXAMPLES
    for path in EXAMPLES:
        VALIDATOR.validate(tomllib.loads(path.read_text()))
    VALIDATOR.validate(checked_tables(auth="none"))  # short for [auth] mode = "none"
    RunConfig.from_dict(checked_tables(auth="none"))


def test_the_schema_requires_what_run_toml_must_have():
    for section in SCHEMA["required"]:
        tables = checked_tables()
        del tables[section]
        assert not VALIDATOR.is_valid(tables), section
        with pytest.raises(ServerConfigError):
            RunConfig.from_dict(tables)


@pytest.mark.parametrize(("tables", "where", "error", "message"), [
    (with_key("round", "deadline", 5), ["round"], UnknownKey,
     r"\[round\] has no key 'deadline'; did you mean 'deadline_s'\? valid keys: min_clients, "),
    ({**checked_tables(), "rond": {"rounds": 3}}, [], UnknownKey,
     r"run\.toml has no key 'rond'; did you mean 'round'\? valid keys: run, model, "),
    (with_key("checkpoint", "keep_last", 1), ["checkpoint", "keep_last"], InvalidValue,
     r"\[checkpoint\] keep_last must lie in \[2, 1000000\], got 1\."),
    (with_key("update", "schedule", "cosin"), ["update", "schedule"], InvalidValue,
     r"\[update\] schedule 'cosin' is not one of cosine, linear, constant; did you mean "
     r"'cosine'\? choose one\."),
    (with_key("auth", "mode", "tokn"), ["auth"], InvalidValue,
     r"\[auth\] mode 'tokn' is not one of token, keys, none; did you mean 'token'\? choose "
     r"one \(token: clients present the join token; keys: .*; none: .*loopback only\)\."),
])
def test_the_schema_and_run_config_refuse_the_same_mistake_in_a_file(tmp_path, tables, where,
                                                                     error, message):
    path = write_run_toml(tmp_path / "run.toml", tables)
    refused = list(VALIDATOR.iter_errors(tomllib.loads(path.read_text())))
    assert refused and all(list(e.absolute_path) == where for e in refused), refused
    with pytest.raises(error) as said:
        RunConfig.load(path)
    assert re.fullmatch(message + ".*", str(said.value)), str(said.value)


@pytest.mark.parametrize(("name", "key", "prop"), KEYS, ids=[f"{n}.{k}" for n, k, _ in KEYS])
def test_every_key_has_a_description(name, key, prop):
    assert prop.get("description", "").strip(), f"[{name}] {key}"


def test_the_schema_has_the_keys_run_config_holds_and_their_defaults():
    given = checked_tables()
    config = RunConfig.from_dict(given)
    held = config.to_dict()  # unset keys left out
    for name, section in SCHEMA["properties"].items():
        keys = keys_of(section)
        assert set(keys) == {f.name for f in dataclasses.fields(getattr(config, name))}, name
        left_out = {k: p for k, p in keys.items() if k not in given.get(name, {})}
        stated = {k: p["default"] for k, p in left_out.items() if "default" in p}
        assert {k: held[name].get(k) for k in stated} == stated, name
        assert not {k for k in left_out if k not in stated} & set(held[name]), name


@pytest.mark.parametrize(("name", "key", "word", "bound"), BOUNDS,
                         ids=[f"{n}.{k}.{w}" for n, k, w, _ in BOUNDS])
def test_a_value_just_outside_a_bound_of_the_schema_is_refused_by_its_key(name, key, word,
                                                                          bound):
    prop = keys_of(SCHEMA["properties"][name])[key]
    outside = bound if word == "exclusiveMinimum" else \
        step(prop, bound, -1 if word == "minimum" else 1)
    assert not VALIDATOR.is_valid(with_key(name, key, outside))
    with pytest.raises(InvalidValue) as refused:
        RunConfig.from_dict(with_key(name, key, outside))
    said = str(refused.value)
    assert re.match(rf"(\[{name}\] |{name}\.){key} must ", said), said


@pytest.mark.parametrize(("name", "key", "word", "bound"), BOUNDS,
                         ids=[f"{n}.{k}.{w}" for n, k, w, _ in BOUNDS])
def test_a_bound_of_the_schema_is_refused_only_by_a_check_across_keys(name, key, word, bound):
    prop = keys_of(SCHEMA["properties"][name])[key]
    inside = step(prop, bound, 1) if word == "exclusiveMinimum" else bound
    assert VALIDATOR.is_valid(with_key(name, key, inside))
    try:
        RunConfig.from_dict(with_key(name, key, inside))
    except InvalidValue as refused:  # e.g. heartbeat_s at its maximum, beyond heartbeat_timeout_s
        others = set(re.findall(r"\w+", str(refused))) & (NAMES - {key})
        assert others, str(refused)
