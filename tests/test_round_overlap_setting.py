"""[round] overlap: on unless run.toml turns it off, read as a TOML boolean and nothing else;
the testnet's --overlap/--no-overlap set it, and without either leave the run's own."""

from __future__ import annotations

import tomllib

import pytest
from support.helpers import checked_tables

from matformer.server.config import RunConfig
from matformer.server.errors import WrongType
from matformer.server.sections import RoundSection


def round_table(**keys) -> dict:
    return checked_tables(round={"rounds": 10, **keys})


def test_overlap_is_on_by_default():
    assert RoundSection(rounds=1).overlap is True
    assert RunConfig.from_dict(round_table()).round.overlap is True


@pytest.mark.parametrize("value", [True, False])
def test_overlap_is_read_and_round_trips(value):
    written = tomllib.loads(f"[round]\nrounds = 10\noverlap = {str(value).lower()}\n")["round"]
    config = RunConfig.from_dict(checked_tables(round=written))
    assert config.round.overlap is value
    assert config.to_dict()["round"]["overlap"] is value
    assert RunConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(("flags", "override"), [
    ([], None), (["--overlap"], "round.overlap=true"),
    (["--no-overlap"], "round.overlap=false")])
def test_the_testnet_flags_set_overlap_and_without_one_leave_the_runs(tmp_path, flags,
                                                                     override):
    from matformer.local_testnet.main import parse_args, prepare_run

    args = parse_args(["--run-dir", str(tmp_path / "run"), *flags])
    overrides = prepare_run(args)[1]
    assert [o for o in overrides if o.startswith("round.overlap")] == (
        [override] if override else [])


@pytest.mark.parametrize("value", ["true", "yes", 1, 0, 1.0, [True]])
def test_overlap_that_is_not_a_boolean_is_refused_naming_the_key(value):
    with pytest.raises(WrongType, match=r"round\.overlap must be a bool, got "):
        RunConfig.from_dict(round_table(overlap=value))
