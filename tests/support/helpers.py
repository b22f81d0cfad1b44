"""What test modules build alike: small runs as run.toml's tables, the one writer of a
run.toml, and a clock that moves only when a test moves it.

    RunConfig.from_dict(checked_tables(round={"rounds": 3}))   # a config that is never run
    run_config(tmp_path / "run", mdat_path, min_clients=2)    # the in-process coordinator's
    served_run_toml(tmp_path, min_clients=1)                  # a served run, its data beside it
    write_run_toml(path, run_tables(mdat, round={...}))       # any other run, as a file
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
from pathlib import Path
from typing import Any

from matformer.modeling.mdat import build_default_mdat
from matformer.server.config import RunConfig
from support.models import tiny_config

JOIN_TOKEN = "join-secret"
RELAY_TOKEN = "relay-secret"  # [auth] relay_token of run_tables' runs
OPERATOR_TOKEN = "operator-secret"
# The model of configs that are checked and never built into weights.
CHECKED_MODEL = {"vocab_size": 260, "hidden_size": 64, "num_attention_heads": 4,
                 "intermediate_size": 256, "max_position_embeddings": 256}
# local-testnet's model: one layer, quick to load in each of its client processes.
TESTNET_MODEL = {"vocab_size": 260, "hidden_size": 32, "num_hidden_layers": 1,
                 "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64,
                 "max_position_embeddings": 128}


class Clock:
    """A coordinator's clock that stands still until a test sets ``now``."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# a small model `matformer train` tests train (as --config model.json) on 40 documents
TRAIN_MODEL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "intermediate_size": 128,
               "max_position_embeddings": 512}


def train_data(folder: Path) -> Path:
    """``folder`` with ``docs.mdat`` (the default corpus's first 40 documents) and
    ``model.json`` (TRAIN_MODEL) in it."""
    build_default_mdat(folder / "docs.mdat", limit=40).close()
    (folder / "model.json").write_text(json.dumps(TRAIN_MODEL))
    return folder


def checked_tables(**tables: Any) -> dict[str, Any]:
    """The smallest valid run.toml as data, for a config that is checked and never run (no
    file is read); ``tables`` replace whole tables (``auth="none"`` too)."""
    return {"run": {"id": "r1", "dir": "out"}, "model": {"inline": dict(CHECKED_MODEL)},
            "data": {"path": "data.mdat"}, "round": {"rounds": 10},
            "auth": {"join_token": JOIN_TOKEN}, **tables}


def run_tables(mdat: str | Path, /, **tables: Any) -> dict[str, Any]:
    """A small run that trains, as run.toml's tables: support.models' tiny model (bytes'
    vocabulary, 128 positions), 128-token sequences of the MDAT at ``mdat``, tiers 0 and 1,
    rounds of 1,024 tokens for one client under plain SGD, dense results. ``tables``
    replace whole tables. Rounds are synchronous unless [round] says ``overlap``: the
    tests written against one round at a time say what they need, and overlapped rounds,
    the run's default, are tested where they are named."""
    model = dataclasses.asdict(tiny_config(vocab_size=260, max_position_embeddings=128))
    if "round" in tables:
        tables["round"] = {"overlap": False, **tables["round"]}
    return {
        "run": {"id": "test", "dir": "run"},
        "model": {"inline": {k: v for k, v in model.items() if v is not None}},
        "data": {"path": str(mdat), "max_seq_len": 128},
        "tiers": {"allowed": [0, 1]},
        "round": {"min_clients": 1, "deadline_s": 30.0, "tokens_per_round": 1024, "rounds": 5,
                  "overlap": False},
        "update": {"rule": "sgd", "lr": 0.1, "schedule": "constant"},
        "compression": {"encoding": "dense"},
        "auth": {"join_token": JOIN_TOKEN, "relay_token": RELAY_TOKEN},
        **tables,
    }


def run_config(run_dir: Path, mdat_path: Path, **round_overrides: Any) -> RunConfig:
    """The in-process coordinator's run: one client, 10 s deadlines, 20 rounds, checkpoints
    every 2 rounds; ``round_overrides`` change keys of [round]."""
    rounds = {"min_clients": 1, "deadline_s": 10.0, "tokens_per_round": 1024, "rounds": 20}
    return RunConfig.from_dict(run_tables(
        mdat_path, run={"id": "test", "dir": str(run_dir)},
        round={**rounds, **round_overrides}, checkpoint={"every_rounds": 2}))


def served_run_toml(folder: Path, min_clients: int = 2, **tables: Any) -> Path:
    """``folder``/run.toml of the run "svc-test" that tests serve on loopback, with the
    default corpus's first 30 documents beside it (docs.mdat); ``tables`` replace whole
    tables."""
    build_default_mdat(folder / "docs.mdat", limit=30).close()
    rounds = {"min_clients": min_clients, "deadline_s": 30.0, "tokens_per_round": 1024,
              "rounds": 5}
    return write_run_toml(folder / "run.toml", run_tables(
        "docs.mdat", **{"run": {"id": "svc-test", "dir": "run"}, "round": rounds, **tables}))


def local_testnet_toml(path: Path, *, deadline: float = 60.0, tokens: int = 1024,
                     rounds: int = 5, min_clients: int = 2, late_rounds: int = 0,
                     **tables: Any) -> Path:
    """A run.toml at ``path`` for local-testnet's processes, its data d.mdat beside it:
    rounds of ``min_clients`` clients (two), sign updates and DeMo's compression (the
    defaults); ``tables`` replace whole tables."""
    return write_run_toml(path, {
        "run": {"id": "t", "dir": "run"},
        "model": {"inline": dict(TESTNET_MODEL)},
        "data": {"path": "d.mdat", "max_seq_len": 128},
        "tiers": {"allowed": [0, 1]},
        "round": {"min_clients": min_clients, "deadline_s": deadline,
                  "tokens_per_round": tokens, "rounds": rounds, "overlap": False,
                  "late_rounds": late_rounds},
        "update": {"rule": "sign", "lr": 0.005},
        "auth": {"join_token": "secret-token-for-tests"},
        **tables,
    })


def write_run_toml(path: Path, tables: dict[str, Any]) -> Path:
    """``tables`` as TOML at ``path``: values that are not tables first (``auth = "none"``),
    as TOML requires, then one [table] each; None values are left out. Returns ``path``."""
    lines = [f"{key} = {_toml_value(value)}" for key, value in tables.items()
             if not isinstance(value, dict)]
    for name, table in tables.items():
        if isinstance(table, dict):
            lines += ["", f"[{name}]"]
            lines += [f"{key} = {_toml_value(value)}" for key, value in table.items()
                      if value is not None]
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml_value(value: Any) -> str:
    """An inline TOML value; None entries of tables are left out (TOML has no null)."""
    if isinstance(value, dict):
        pairs = (f"{k} = {_toml_value(v)}" for k, v in value.items() if v is not None)
        return "{ " + ", ".join(pairs) + " }"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)


def run_testnet(argv: list[str], *, timeout: float, **popen: Any
                ) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a testnet: past ``timeout`` it is stopped with SIGTERM, which
    stops its server and clients too (SIGKILL, as ``subprocess.run`` sends, would leave them
    running behind the test), and the output so far comes back with return code 124."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, **popen)
    try:
        out, err = process.communicate(timeout=timeout)
        return subprocess.CompletedProcess(argv, process.returncode, out, err)
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            out, err = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
        err += f"\n[test] the testnet ran past {timeout} s and was stopped\n"
        return subprocess.CompletedProcess(argv, 124, out, err)
