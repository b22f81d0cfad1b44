"""What a newcomer met in a first hour with the commands (issue 32), one test per friction:
each fails on the code as it was and passes now."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from client.cli import SHARED, parse_args
from client.federated import FederatedOptions


@pytest.mark.parametrize(("flags", "named"), [
    (["--lr", "0.1"], "--lr applies"),
    (["--steps", "5", "--optimizer", "muon", "--out", "x", "--track", "none"],
     "--steps, --optimizer, --out, --track apply"),
    (["--fsdp"], "--fsdp applies"),
    (["--set", "training.lr=0.1"], "--set applies"),
])
def test_a_federated_client_refuses_the_flags_of_standalone_training(flags, named, capsys):
    """They were accepted and ignored: the coordinator's run.toml decides them."""
    with pytest.raises(SystemExit) as exited:
        parse_args(["train", "--server", "127.0.0.1:7070", *flags])
    assert exited.value.code == 2
    said = capsys.readouterr().err
    assert f"{named} to standalone training only" in said
    assert "leave out --server" in said


def test_standalone_training_refuses_the_flags_of_a_federated_run(capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(["train", "--tier", "1", "--name", "laptop", "--max-rounds", "3"])
    assert exited.value.code == 2
    assert ("--tier, --name, --max-rounds apply to a federated run only: add --server HOST:PORT"
            in capsys.readouterr().err)


def test_the_flags_both_kinds_of_training_read_are_taken_by_a_federated_client():
    args = parse_args(["train", "--server", "127.0.0.1:7070", "--device", "cpu",
                       "--precision", "bf16", "--batching", "padded", "--microbatch-tokens",
                       "256", "--microbatch-examples", "8", "--data", "docs.mdat"])
    assert set(SHARED) <= {f.name for f in FederatedOptions.__dataclass_fields__.values()}
    assert (args.precision, args.batching, args.microbatch_tokens) == ("bf16", "padded", 256)


def test_the_client_command_exits_at_once_on_an_ignored_flag():
    done = subprocess.run(
        [sys.executable, "-m", "client.cli", "train", "--server", "127.0.0.1:7070", "--lr",
         "0.1"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        "matformer-client train: error: --lr applies to standalone training only (in a "
        "federated run the coordinator's run.toml decides). Drop it, or leave out --server "
        "to train on this machine alone.")
