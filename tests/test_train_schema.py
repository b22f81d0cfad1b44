"""train.toml and the strategy file, declared once (`modeling.settings`): each key of
train.toml is one flag of matformer-train and back, the flag and the key checked alike; a typo
gets a did-you-mean, a value out of range its range; the schemas take what the repo ships."""

from __future__ import annotations

import json
import re
import tomllib
import types
from dataclasses import Field, fields
from pathlib import Path
from typing import Any, get_args, get_type_hints

import pytest
from jsonschema import Draft202012Validator

from matformer.client.standalone import parse_args
from matformer.client.train_config import SECTIONS, apply, attribute, train_schema
from matformer.modeling.errors import InvalidValue, StrategyError, UnknownKey
from matformer.modeling.mdat import DEFAULT_STRATEGY, Strategy
from matformer.modeling.mdat.strategy import strategy_schema
from matformer.modeling.settings import FolderOrRepo, choices_of, flag_of

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train.toml"
SEED_STRATEGY = ROOT / "tests" / "fixtures" / "seed000_strategy.json"
KEYS = [(section, key) for section, declared in SECTIONS.items() for key in fields(declared)]
HAND_WRITTEN = {"set", "resume"}  # options of matformer-train that are no key of train.toml


def kind_of(section: str, key: Field) -> type:
    """The type ``key`` declares (``X`` of ``X | None``)."""
    hint = get_type_hints(SECTIONS[section])[key.name]
    return next(a for a in get_args(hint) if a is not type(None)) \
        if isinstance(hint, types.UnionType) else hint


PATHS = [(s, k) for s, k in KEYS if kind_of(s, k) in (Path, FolderOrRepo)]


def sample(section: str, key: Field) -> Any:
    """A valid value of ``key`` other than its default, from its declaration alone."""
    kind = kind_of(section, key)
    if (choices := choices_of(key.metadata)) is not None:
        return next(choice for choice in choices if choice != key.default)
    if kind is bool:
        return not key.default
    if kind in (int, float):
        start = key.default if key.default is not None else key.metadata["low"] or 0
        return kind(start + 1)  # every range here is a floor
    if kind is str:
        return f"{key.default or ''}0"  # "0,1,20" still names tiers
    return "sample"  # a path, relative to the file's folder and to the cwd alike


def flag_argv(key: Field, value: Any) -> list[str]:
    if isinstance(value, bool):
        return [flag_of(key) if value else f"--no-{flag_of(key)[2:]}"]
    return [flag_of(key), str(value)]


def test_every_option_of_matformer_train_is_one_key_or_hand_written():
    options = set(vars(parse_args([])))  # every option's destination
    names = [key.name for _, key in KEYS]
    flags = [flag_of(key) for _, key in KEYS]
    assert len(set(names)) == len(names) and len(set(flags)) == len(flags)
    assert options - HAND_WRITTEN == set(names)


@pytest.mark.parametrize(("section", "key"), KEYS, ids=[f"{s}.{k.name}" for s, k in KEYS])
def test_a_flag_and_its_key_in_a_file_give_the_same_checked_value(tmp_path, monkeypatch,
                                                                   section, key):
    monkeypatch.chdir(tmp_path)
    value = sample(section, key)
    (tmp_path / "train.toml").write_text(f"[{section}]\n{key.name} = {json.dumps(value)}\n")
    from_file = apply(parse_args(["--config", str(tmp_path / "train.toml")]))
    from_flag = apply(parse_args(flag_argv(key, value)))
    default = apply(parse_args([]))
    name = attribute(key)
    assert getattr(from_file, name) == getattr(from_flag, name) != getattr(default, name)


@pytest.mark.parametrize(("section", "key"), PATHS, ids=[f"{s}.{k.name}" for s, k in PATHS])
def test_a_path_in_the_file_is_relative_to_it_and_a_flags_to_the_cwd(tmp_path, monkeypatch,
                                                                     section, key):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "train.toml").write_text(f'[{section}]\n{key.name} = "here"\n')
    monkeypatch.chdir(tmp_path)
    config = ["--config", "conf/train.toml"]
    from_file = apply(parse_args(config))
    flagged = apply(parse_args([*config, flag_of(key), "here"]))
    assert str(getattr(from_file, attribute(key))) == str(tmp_path / "conf" / "here")
    assert str(getattr(flagged, attribute(key))) == str(tmp_path / "here")


def test_init_takes_a_hub_id_where_no_such_folder_is(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert apply(parse_args(["--init", "org/model"])).init.is_repo
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert apply(parse_args(["--init", "org/model"])).init == str(tmp_path / "org" / "model")


def test_a_typo_gets_a_did_you_mean(tmp_path):
    (tmp_path / "train.toml").write_text("[training]\nlrr = 0.1\n")
    with pytest.raises(UnknownKey, match=r"\[training\] has no key 'lrr'; did you mean 'lr'\?"):
        apply(parse_args(["--config", str(tmp_path / "train.toml")]))
    with pytest.raises(UnknownKey, match=r"has no section \[trainig\]; did you mean 'training'"):
        apply(parse_args(["--config", str(tmp_path / "train.toml"), "--set", "trainig.lr=1"]))


@pytest.mark.parametrize(("key", "value", "message"), [
    ("steps", 0, r"\[training\] steps must be >= 1, got 0\."),
    ("lr", -1, r"\[training\] lr must be > 0, got -1\.0\."),
])
def test_a_value_out_of_range_names_the_range_in_the_file_and_the_flag(tmp_path, key, value,
                                                                       message):
    (tmp_path / "train.toml").write_text(f"[training]\n{key} = {value}\n")
    said = []
    for argv in (["--config", str(tmp_path / "train.toml")], [f"--{key}", str(value)]):
        with pytest.raises(InvalidValue) as refused:
            apply(parse_args(argv))
        said.append(str(refused.value))
    assert said[0] == said[1] and re.fullmatch(message, said[0])


def test_the_schema_of_train_toml_takes_the_example_and_refuses_typos():
    schema = train_schema()
    Draft202012Validator.check_schema(json.loads(json.dumps(schema)))
    validator = Draft202012Validator(schema)
    example = tomllib.loads(EXAMPLE.read_text())
    validator.validate(example)
    validator.validate({"model": {"config": "model.json"}, "training": {"tiers": [0, 1]}})
    for wrong in ({**example, "training": {**example["training"], "lrr": 0.1}},
                  {**example, "trainig": {}}, {"training": {"steps": 0}},
                  {"training": {"tiers": "0,one"}}, {"model": {"hiden_size": 64}},
                  {"model": {"config": "model.json", "init": "runs/base"}}):
        assert not validator.is_valid(wrong), wrong


@pytest.mark.parametrize("definition", [DEFAULT_STRATEGY, json.loads(SEED_STRATEGY.read_text())],
                         ids=["default", "seed000"])
def test_the_schema_of_a_strategy_takes_the_shipped_ones_and_refuses_typos(definition):
    schema = strategy_schema()
    Draft202012Validator.check_schema(schema)
    validator = Draft202012Validator(schema)
    validator.validate(definition)
    validator.validate(Strategy.from_dict(definition).to_dict())  # as a container stores it
    assert not validator.is_valid({**definition, "chunk_sise": 64})
    assert not validator.is_valid({**definition, "chunk_size": 0})


def test_a_strategy_typo_gets_a_did_you_mean_and_a_range_its_range():
    with pytest.raises(StrategyError, match=r"\[strategy\] has no key 'chunk_sise'; did you "
                                            r"mean 'chunk_size'\?"):
        Strategy.from_dict({"strategy_name": "s", "chunk_sise": 64})
    with pytest.raises(StrategyError, match=r"\[strategy\] chunk_size must be >= 1, got 0\."):
        Strategy.from_dict({"strategy_name": "s", "chunk_size": 0})


def test_a_checkpoint_saved_with_relative_paths_compares_them_from_where_it_resumes(
        tmp_path, monkeypatch):
    from matformer.client.run_checkpoints import _absolute

    monkeypatch.chdir(tmp_path)
    (tmp_path / "base").mkdir()
    saved = {"data": "docs.mdat", "init": "base", "config": "None", "lr": "0.003"}
    assert _absolute(saved) == {"data": str(tmp_path / "docs.mdat"),
                                "init": str(tmp_path / "base"), "config": "None", "lr": "0.003"}
    assert _absolute({"init": "org/model"}) == {"init": "org/model"}  # a hub id stays
