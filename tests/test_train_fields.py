"""Every key of train.toml reaches the training loop: one case per key, run through
``--config train.toml --set SECTION.KEY=VALUE``, each checking an effect that disappears
if the key were ignored (other weights, another plan of microbatches, files, an error)."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from matformer.client import standalone
from matformer.client.standalone import TINY, main
from matformer.client.train_config import SECTIONS
from matformer.modeling.batching import runner
from matformer.modeling.errors import ConfigError
from matformer.modeling.mdat import DEFAULT_STRATEGY, build_default_mdat

SENTENCES = {**DEFAULT_STRATEGY, "strategy_name": "sentences128",
             "splitter_class": "sentence_chunks"}
MODEL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 512}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Two containers: one with a second strategy and a view, one of other documents."""
    folder = tmp_path_factory.mktemp("fields")
    with build_default_mdat(folder / "docs.mdat", limit=40) as mdat:
        mdat.add_strategy(SENTENCES)
        mdat.pretokenize("sentences128")
        mdat.create_view("half", {"python_docs": 0.5})
    build_default_mdat(folder / "other.mdat", limit=25).close()
    (folder / "model.json").write_text(json.dumps({**TINY, **MODEL, "hidden_size": 48}))
    return folder


def run(folder: Path, tmp_path: Path, *sets: str, drop: tuple[str, ...] = ()) -> dict:
    """The base run, less the ``drop`` keys, with ``sets`` applied: its weights, metrics
    and folder."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "train.toml"
    inline = "\n".join(f"{key} = {value}" for key, value in MODEL.items())
    config.write_text(f"""
[model]
{inline}
[data]
path = "{folder / "docs.mdat"}"
seq_len = 128
[training]
steps = 6
warmup_steps = 2
lr = 0.004
tiers = "0"
batch_tokens = 512
[logging]
out = "run"
track = "none"
log_every = 100
""")
    text = config.read_text()
    for key in drop:
        text = "\n".join(line for line in text.splitlines() if not line.startswith(key + " ="))
    config.write_text(text)
    main(["--config", str(config), *(f"--set={s}" for s in sets)])
    named = [s.partition("=")[2].strip('"') for s in sets if s.startswith("logging.out=")]
    out = tmp_path / (named[0] if named else "run")
    return {"weights": load_file(out / "model.safetensors"), "out": out,
            "metrics": json.loads((out / "metrics.json").read_text())}


@pytest.fixture(scope="module")
def base(data, tmp_path_factory):
    return run(data, tmp_path_factory.mktemp("base"))


def differs(a: dict, b: dict) -> bool:
    return a.keys() != b.keys() or any(
        a[k].shape != b[k].shape or not torch.equal(a[k], b[k]) for k in a)


# keys whose value changes what is trained: the weights after six steps must differ
WEIGHTS = {
    "data.path": '"{folder}/other.mdat"',
    "data.strategy": '"sentences128"',
    "data.view": '"half"',
    "data.seq_len": "256",
    "training.optimizer": '"adam"',
    "training.lr": "0.001",
    "training.final_lr": "0.0",
    "training.warmup_steps": "4",
    "training.hold_steps": "2",
    "training.schedule": '"linear"',
    "training.weight_decay": "0.5",
    "training.grad_clip": "0.05",
    "training.batch_tokens": "256",
    "training.seed": "3",
    "hardware.precision": '"bf16"',
}
# the rest, each with its own observable effect below
OTHERS = ("model.config", "model.init", "data.documents", "data.batching", "training.steps",
          "training.epochs", "training.tiers", "training.tier_mode", "training.tier_mixes",
          "training.microbatch_tokens", "training.microbatch_examples",
          "training.save_every", "training.keep_last", "hardware.device", "hardware.compile",
          "hardware.fsdp", "hardware.threads", "logging.track", "logging.project",
          "logging.log_every", "logging.eval", "logging.eval_sequences", "logging.out",
          # their cases: tests/test_train_workers.py and tests/test_train_rows.py
          "data.num_workers", "training.eval_microbatch_tokens", "logging.log_longest_every",
          "logging.debug",
          # tests/test_train_saetta.py, tests/test_seed_rows.py
          "data.saetta", "training.pad_to_multiple_of")


def test_every_key_has_a_case():
    keys = {f"{section}.{key.name}" for section, declared in SECTIONS.items()
            for key in fields(declared)}
    assert keys == set(WEIGHTS) | set(OTHERS)


@pytest.mark.parametrize("key", sorted(WEIGHTS))
def test_the_key_changes_what_is_trained(data, base, tmp_path, key):
    changed = run(data, tmp_path, f"{key}={WEIGHTS[key].format(folder=data)}")
    assert differs(base["weights"], changed["weights"]), key


def test_model_config_names_the_model(data, base, tmp_path, capsys):
    bigger = run(data, tmp_path, f'model.config="{data}/model.json"', drop=tuple(MODEL))
    assert bigger["weights"]["model.embed_tokens.weight"].shape[1] == 48
    with pytest.raises(SystemExit):  # a file and inline fields at once: which is meant?
        run(data, tmp_path / "both", f'model.config="{data}/model.json"')
    assert "[model] takes config = \"model.json\", init = \"CHECKPOINT\" or the model's " \
        "fields inline, one of them" in capsys.readouterr().err


def test_model_init_starts_from_a_checkpoints_weights(data, base, tmp_path):
    """[model] init: the base run's model, finetuned: its architecture, and its weights as
    the start (the held-out loss before the first step is the base run's final one)."""
    tuned = run(data, tmp_path / "tuned", f'model.init="{base["out"]}"', drop=tuple(MODEL))
    assert tuned["metrics"]["initial"] == base["metrics"]["final"]
    assert tuned["weights"].keys() == base["weights"].keys()
    assert differs(base["weights"], tuned["weights"])


def test_batching_packs_short_sequences_together(data, tmp_path):
    # at rows of 128 nearly every sequence fills its row alone; at 512 short ones share rows
    packed = run(data, tmp_path / "packed", "data.seq_len=512", "training.batch_tokens=2048")
    padded = run(data, tmp_path / "padded", "data.seq_len=512", "training.batch_tokens=2048",
                 'data.batching="padded"')
    assert differs(packed["weights"], padded["weights"])
    assert (packed["metrics"]["batching"], padded["metrics"]["batching"]) == ("packed", "padded")


def test_documents_limits_the_default_container(data, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the default container is built under ./runs
    changed = run(data, tmp_path, "data.documents=20", drop=("path",))
    assert "runs/python_docs-20.mdat" in capsys.readouterr().out
    with build_default_mdat(tmp_path / "runs/python_docs-20.mdat", limit=20) as mdat:
        assert [s.documents for s in mdat.submdats()] == [20]
    assert changed["metrics"]["history"]
    with pytest.raises(ConfigError, match=r"holds modeling.corpus.python_docs\(20\), not "):
        build_default_mdat(tmp_path / "runs/python_docs-20.mdat", limit=10)  # never ignored
    with pytest.raises(SystemExit):  # the limit names the default container only
        run(data, tmp_path / "with_data", "data.documents=20")
    assert "--documents limits the default container" in capsys.readouterr().err


def test_the_length_keys_set_the_number_of_steps(data, base, tmp_path):
    assert len(base["metrics"]["history"]) == 6
    assert len(run(data, tmp_path / "s", "training.steps=3")["metrics"]["history"]) == 3
    one = run(data, tmp_path / "e1", "training.epochs=1", drop=("steps",))
    two = run(data, tmp_path / "e2", "training.epochs=2", drop=("steps",))
    assert len(two["metrics"]["history"]) == 2 * len(one["metrics"]["history"]) > 0


def test_tiers_and_tier_mode_choose_what_each_step_trains(data, tmp_path):
    both = run(data, tmp_path / "t", "training.tiers=[0, 2]")
    assert all(set(h["loss"]) == {"0", "2"} for h in both["metrics"]["history"])
    sample = run(data, tmp_path / "m", "training.tiers=[0, 1, 2]", 'training.tier_mode="sample"')
    assert all(len(h["loss"]) == 1 for h in sample["metrics"]["history"])
    # two layers at tiers 0 and 2: the one mix that is not uniform, drawn every step
    mixed = run(data, tmp_path / "x", "training.tiers=[0, 2]", "training.tier_mixes=1")
    assert all(set(h["loss"]) == {"0", "2", "mix:0,2"} for h in mixed["metrics"]["history"])


@pytest.mark.parametrize("key, value, check", [
    ("training.microbatch_tokens", "256", lambda plan, rows: max(rows) <= 1 and plan > 6),
    ("training.microbatch_examples", "1", lambda plan, rows: max(rows) == 1),
])
def test_microbatch_limits_shape_every_pass(data, tmp_path, monkeypatch, key, value, check):
    plans = []

    def recording(lengths, *, max_tokens, max_examples, pad_to_multiple_of=1):
        plan = split(lengths, max_tokens=max_tokens, max_examples=max_examples,
                     pad_to_multiple_of=pad_to_multiple_of)
        plans.append(plan)
        return plan

    split = runner.split_microbatches
    monkeypatch.setattr(runner, "split_microbatches", recording)
    run(data, tmp_path / "base", "data.seq_len=256")
    assert max(len(mb) for plan in plans for mb in plan) > 1  # the defaults group rows
    plans.clear()
    run(data, tmp_path / "changed", "data.seq_len=256", f"{key}={value}")
    rows = [len(mb) for plan in plans for mb in plan]
    assert check(len(rows), rows), rows


def test_checkpoint_keys_write_and_prune_step_folders(data, tmp_path):
    run(data, tmp_path, "training.save_every=2", "training.keep_last=2")
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == \
        ["step-4", "step-6"]
    run(data, tmp_path / "three", "training.save_every=1", "training.keep_last=3")
    assert sorted(p.name for p in (tmp_path / "three/run/checkpoints").iterdir()) == \
        ["step-4", "step-5", "step-6"]


@pytest.mark.parametrize("key, message", [
    ('hardware.device="cuda:7"', "device 'cuda:7'"),
    ("hardware.fsdp=true", "--fsdp shards the model over the ranks torchrun starts"),
])
def test_hardware_keys_reach_the_device_setup(data, tmp_path, capsys, key, message):
    with pytest.raises(SystemExit) as exit_info:
        run(data, tmp_path, key)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_compile_compiles_the_model(data, tmp_path, monkeypatch):
    compiled = []
    monkeypatch.setattr(standalone, "compile_model", compiled.append)
    result = run(data, tmp_path, "hardware.compile=true")
    assert len(compiled) == 1 and result["metrics"]["compile"] is True


def test_threads_sets_the_threads_torch_computes_with(data, tmp_path, monkeypatch):
    chosen = []
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    result = run(data, tmp_path, "hardware.threads=3")
    assert chosen == [3] and result["metrics"]["threads"] == 3


def test_eval_keys_choose_what_the_held_out_loss_reads(data, tmp_path, capsys):
    """eval_sequences caps the sequences read (and training's tokens cap them too: 6 steps
    of 512 tokens are 24 sequences of 128); eval = false reads none, and says nothing."""
    run(data, tmp_path / "two", "logging.eval_sequences=2")
    assert "held-out loss of tiers [0] on 2 sequences" in capsys.readouterr().out
    run(data, tmp_path / "capped", "logging.eval_sequences=1000")
    assert re.search(r"held-out loss of tiers \[0\] on (\d+) sequences",
                     capsys.readouterr().out).group(1) in {str(n) for n in range(1, 25)}
    result = run(data, tmp_path / "none", "logging.eval=false")
    assert "held-out" not in capsys.readouterr().out
    assert result["metrics"]["initial"] == result["metrics"]["final"] == {}


def test_logging_keys_choose_where_and_how_often(data, tmp_path, capsys):
    result = run(data, tmp_path, 'logging.track="tensorboard"', "logging.log_every=2",
                 'logging.out="elsewhere"')
    assert result["out"] == tmp_path / "elsewhere" and not (tmp_path / "run").exists()
    printed = capsys.readouterr().out
    assert [line.split()[1] for line in printed.splitlines() if line.startswith("step ")] == \
        ["2/6", "4/6", "6/6"]
    assert (tmp_path / "elsewhere" / "model.safetensors").is_file()
    assert any((tmp_path / "elsewhere" / "tensorboard").iterdir())


def test_project_names_the_tracked_run(data, tmp_path, monkeypatch):
    import importlib.machinery
    import types

    calls = []  # what the tracking library is asked to do (trackio and W&B share the API)
    library = types.ModuleType("trackio")
    library.__spec__ = importlib.machinery.ModuleSpec("trackio", None)
    library.init = lambda **kwargs: calls.append(("init", kwargs["project"], kwargs["name"]))
    library.log = lambda scalars, step: calls.append(("log", step, sorted(scalars)))
    library.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "trackio", library)
    run(data, tmp_path, 'logging.track="trackio"', 'logging.project="ablations"')
    assert calls[0] == ("init", "ablations", "run") and calls[-1] == ("finish",)
    assert [c[1] for c in calls if c[0] == "log"] == [0, 1, 2, 3, 4, 5, 6, 6]
