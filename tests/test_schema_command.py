"""`matformer schema KIND` writes the schema that the shipped examples validate against."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from matformer.modeling.mdat import DEFAULT_STRATEGY
from matformer.scripts.verbs import main

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize(("kind", "example"), [
    ("run", tomllib.loads((EXAMPLES / "run.toml").read_text())),
    ("train", tomllib.loads((EXAMPLES / "train.toml").read_text())),
    ("strategy", dict(DEFAULT_STRATEGY)),
])
def test_the_schema_a_verb_writes_validates_the_example_and_refuses_a_typo(
        tmp_path, kind, example):
    out = tmp_path / f"{kind}.schema.json"
    assert main(["schema", kind, "--out", str(out)]) == 0
    validator = Draft202012Validator(json.loads(out.read_text()))
    Draft202012Validator.check_schema(validator.schema)
    assert list(validator.iter_errors(example)) == []
    typo = {**example, "no_such_key": 1}
    assert [e.validator for e in validator.iter_errors(typo)] == ["additionalProperties"]


def test_an_unknown_kind_is_refused_with_the_kinds(capsys):
    with pytest.raises(SystemExit) as done:
        main(["schema", "runn"])
    assert done.value.code == 2
    assert "invalid choice: 'runn'" in capsys.readouterr().err
