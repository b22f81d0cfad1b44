"""[round] overlap: off unless run.toml turns it on, read as a TOML boolean and nothing else."""

from __future__ import annotations

import tomllib

import pytest
from support.helpers import checked_tables

from matformer.server.config import RunConfig
from matformer.server.errors import WrongType
from matformer.server.sections import RoundSection


def round_table(**keys) -> dict:
    return checked_tables(round={"rounds": 10, **keys})


def test_overlap_is_off_by_default():
    assert RoundSection(rounds=1).overlap is False
    assert RunConfig.from_dict(round_table()).round.overlap is False


def test_overlap_true_is_read_and_round_trips():
    written = tomllib.loads("[round]\nrounds = 10\noverlap = true\n")["round"]
    config = RunConfig.from_dict(checked_tables(round=written))
    assert config.round.overlap is True
    assert config.to_dict()["round"]["overlap"] is True
    assert RunConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("value", ["true", "yes", 1, 0, 1.0, [True]])
def test_overlap_that_is_not_a_boolean_is_refused_naming_the_key(value):
    with pytest.raises(WrongType, match=r"round\.overlap must be a bool, got "):
        RunConfig.from_dict(round_table(overlap=value))
