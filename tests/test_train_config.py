"""`matformer-train --config train.toml`: the file's keys reach the run, unknown ones are
refused by name, --set and flags override, and examples/train.toml states the defaults."""

from __future__ import annotations

import json
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest

from matformer.client.standalone import TINY, main, parse_args
from matformer.client.train_config import SECTIONS, apply
from matformer.modeling.mdat import build_default_mdat

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train.toml"


def test_the_example_names_every_key_and_states_the_defaults():
    tables = tomllib.loads(EXAMPLE.read_text())
    text = EXAMPLE.read_text()
    for section, declared in SECTIONS.items():
        for key in fields(declared):
            assert f"{key.name} = " in text, f"[{section}] {key.name} is not in examples/train.toml"
    args = apply(parse_args(["--config", str(EXAMPLE)]))
    defaults = apply(parse_args([]))
    for section, table in tables.items():
        for key, value in table.items():
            if section == "model":
                assert TINY[key] == value, key  # the default model, spelled out
            elif key != "out":
                dest = "data" if (section, key) == ("data", "path") else key
                assert getattr(args, dest) == getattr(defaults, dest), (section, key)


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "docs.mdat"
    build_default_mdat(path, limit=40).close()
    return path


def write(tmp_path, docs, extra=""):
    path = tmp_path / "train.toml"
    path.write_text(f"""
[model]
hidden_size = 64
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
intermediate_size = 256
max_position_embeddings = 128

[data]
path = "{docs}"
seq_len = 128

[training]
steps = 4
warmup_steps = 1
lr = 0.004
tiers = [0, 1]
batch_tokens = 512
{extra}
[logging]
out = "run"
track = "none"
""")
    return path


def test_the_files_keys_reach_the_run_and_set_and_flags_override(docs, tmp_path):
    config = write(tmp_path, docs)
    main(["--config", str(config), "--set", "training.lr=0.002", "--set", "training.steps=3",
          "--warmup-steps", "2"])
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [h["lr"] for h in metrics["history"]] == pytest.approx([0.001, 0.002, 0.002])
    assert set(metrics["final"]) == {"0", "1"}  # tiers = [0, 1]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (saved["hidden_size"], saved["num_hidden_layers"]) == (64, 2)  # inline [model]


@pytest.mark.parametrize("extra, message", [
    ("lrate = 0.1\n", r"\[training\] has no key 'lrate'; .*valid keys: steps, epochs"),
    ("lr = \"fast\"\n", r"training.lr must be a number, got 'fast'"),
    ("schedule = \"step\"\n", r"\[training\] schedule 'step' is not one of cosine"),
    ("[optim]\nlr = 1\n", r"has no section \[optim\]; valid: model, data"),
])
def test_bad_keys_are_refused_naming_them(docs, tmp_path, capsys, extra, message):
    import re

    config = write(tmp_path, docs, extra)
    if extra.startswith("lr ="):  # in place of the file's own lr
        config.write_text(config.read_text().replace("lr = 0.004\n", "", 1))
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(config)])
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_a_bare_model_config_still_works_and_set_needs_a_toml(docs, tmp_path, capsys):
    model = tmp_path / "model.json"
    model.write_text(json.dumps({**TINY, "hidden_size": 64, "num_hidden_layers": 2,
                                 "intermediate_size": 256, "max_position_embeddings": 128}))
    main(["--config", str(model), "--data", str(docs), "--seq-len", "128", "--steps", "2",
          "--warmup-steps", "1", "--tiers", "0", "--track", "none", "--out",
          str(tmp_path / "run")])
    assert (tmp_path / "run" / "model.safetensors").is_file()
    with pytest.raises(SystemExit):
        main(["--config", str(model), "--set", "training.lr=1", "--data", str(docs)])
    assert "--set overrides keys of a train.toml" in capsys.readouterr().err
