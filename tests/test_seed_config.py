"""Seed 000's own config: its config JSON trains with matformer-train (its strategy JSON
pretokenizes the data), keys without a mapping are named, ffn_factor and
training_objective are model fields, and the registry builds a component from config fields."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import shutil
from pathlib import Path

import pytest

from matformer.client.standalone import main, parse_args
from matformer.client.train_config import apply
from matformer.modeling import ModelConfig, registry
from matformer.modeling.errors import ConfigError
from matformer.modeling.mdat import Mdat
from matformer.modeling.tokenizers import train_tokenizer

FIXTURES = Path(__file__).parent / "fixtures"
SEED_CONFIG = FIXTURES / "seed000_config.json"  # the seed's five sections, as it writes them
SEED_STRATEGY = FIXTURES / "seed000_strategy.json"  # the seed's "Minerva1024", as written
HUB_TOKENIZER = "sapienzanlp/Minerva-350M-base-v1.0"


@pytest.fixture
def seed_run(tmp_path, monkeypatch):
    """The seed config in a folder beside the data it names: ./datasets/mini_dataset_1000,
    pretokenized by the seed's strategy, whose tokenizer (a small BPE standing in for
    Minerva's) is read from an offline hub cache."""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with Mdat.create(tmp_path / "run" / "datasets" / "mini_dataset_1000") as mdat:
        mdat.add_records("docs", ({"text": f"Documento {i}. Il Sig. Rossi legge il libro "
                                            f"numero {i}, poi scrive a Maria."}
                                   for i in range(8)))
        snapshot = (tmp_path / "hub" / f"models--{HUB_TOKENIZER.replace('/', '--')}")
        (snapshot / "refs").mkdir(parents=True)
        (snapshot / "refs" / "main").write_text("a" * 40)
        train_tokenizer(mdat.submdat("docs"), snapshot / "snapshots" / ("a" * 40) /
                        "tokenizer.json", vocab_size=300)
        mdat.add_strategy(SEED_STRATEGY)
        mdat.pretokenize("Minerva1024")
    shutil.copy(SEED_CONFIG, tmp_path / "run" / "seed.json")
    return tmp_path / "run"


def test_the_seeds_config_json_trains(seed_run, caplog, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(seed_run))
    # Shrunk by --set alone, to train in seconds on two CPU cores: the seed's 40M-parameter
    # model takes a minute there, so hidden_size 512 becomes 64 (its 32,769-id vocabulary
    # stays); its warmup (750 steps) and hold (300) become 1 and 0; its one epoch of this
    # container is one step, so two epochs make two.
    with caplog.at_level(logging.WARNING):
        main(["--config", str(seed_run / "seed.json"), "--set", "model_config.hidden_size=64",
              "--set", "training.warmup_steps=1", "--set", "training.hold_steps=0",
              "--set", "training.max_epochs=2"])
    out = seed_run / "checkpoints" / "Test-Model"  # save_dir / wandb_run_name
    metrics = json.loads((out / "metrics.json").read_text())
    assert len(metrics["history"]) == 2 and metrics["batching"] == "padded"
    assert [h["lr"] for h in metrics["history"]] == pytest.approx([5e-4, 5e-4])  # warmed up
    assert all(metrics["final"][t] < metrics["initial"][t] for t in ("0", "1", "2"))
    saved = json.loads((out / "config.json").read_text())
    assert (saved["hidden_size"], saved["intermediate_size"], saved["vocab_size"]) == \
        (64, 64, 32769)  # ffn_factor 1.0
    assert saved["is_causal"] is False and saved["default_layer"]["ffn_activation"] == "gelu"
    said = caplog.text
    assert "is ignored" not in said  # data.num_workers is --num-workers now
    if importlib.util.find_spec("wandb") is None:  # else it tracks there (offline)
        assert "wandb is not installed" in said and (out / "tensorboard").is_dir()


def test_the_seeds_keys_become_these_options(seed_run):
    args = apply(parse_args(["--config", str(seed_run / "seed.json")]))
    assert {key: getattr(args, key) for key in (
        "optimizer", "lr", "final_lr", "schedule", "warmup_steps", "hold_steps",
        "weight_decay", "grad_clip", "epochs", "save_every", "seed", "seq_len",
        "microbatch_examples", "microbatch_tokens", "batch_tokens", "batching", "strategy",
        "view", "project")} == {
        "optimizer": "adam", "lr": 5e-4, "final_lr": 2e-5, "schedule": "cosine",
        "warmup_steps": 750, "hold_steps": 300, "weight_decay": 0.01, "grad_clip": 1.0,
        "epochs": 1, "save_every": 5000, "seed": 27, "seq_len": 1024,
        "microbatch_examples": 4, "microbatch_tokens": 4 * 1024, "batch_tokens": 4 * 5 * 1024,
        "batching": "padded", "strategy": "Minerva1024", "view": None, "project": "Test"}
    assert (args.data, args.out) == (seed_run / "datasets" / "mini_dataset_1000",
                                     seed_run / "checkpoints" / "Test-Model")
    assert args.config is None and args.model_fields["intermediate_size"] == 512
    flags = apply(parse_args(["--config", str(seed_run / "seed.json"), "--lr", "0.01",
                              "--seq-len", "512", "--set", "training.lr_scheduling=false"]))
    assert (flags.lr, flags.seq_len, flags.batch_tokens) == (0.01, 512, 4 * 5 * 512)
    assert (flags.schedule, flags.warmup_steps, flags.hold_steps) == ("constant", 0, 0)


def test_the_tokenizer_section_must_be_the_datas(seed_run, capsys):
    config = json.loads((seed_run / "seed.json").read_text())
    config["tokenizer"]["pretrained_name"] = "org/another"
    (seed_run / "seed.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit):
        main(["--config", str(seed_run / "seed.json")])
    assert re.search(r"tokenizer.pretrained_name 'org/another' is not the data's: strategy "
                     r"'Minerva1024' was tokenized with huggingface 'sapienzanlp/Minerva",
                     capsys.readouterr().err)


def test_keys_without_a_mapping_are_named_in_one_error(tmp_path, capsys):
    config = json.loads(SEED_CONFIG.read_text())
    config["model_config"]["name"] = "Debug"
    config["model_config"]["default_layer"]["sliding_window"] = 128
    config["training"]["gradient_clip"] = 1.0
    config["model_class"] = "Autoregressive_Model"
    (tmp_path / "seed.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(tmp_path / "seed.json")])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    for named in ("'model_config.name'", "'model_config.default_layer.sliding_window'",
                  "'training.gradient_clip' (did you mean 'training.gradient_clip_val'?)",
                  "'model_class'"):
        assert named in err
    assert err.count("error:") == 1 and not (tmp_path / "checkpoints").exists()


def test_ffn_factor_and_training_objective_are_model_fields():
    config = ModelConfig.from_dict({"hidden_size": 768, "num_attention_heads": 12,
                                    "ffn_factor": 4, "training_objective": "masked"})
    assert (config.intermediate_size, config.is_causal) == (3072, False)
    assert "ffn_factor" not in config.to_dict()  # written back in our own fields
    agreeing = ModelConfig.from_dict({"hidden_size": 64, "ffn_factor": 2.5,
                                      "intermediate_size": 160})
    assert agreeing.intermediate_size == 160
    with pytest.raises(ConfigError, match=r"intermediate_size=100 disagrees with ffn_factor"):
        ModelConfig.from_dict({"hidden_size": 64, "ffn_factor": 2, "intermediate_size": 100})
    with pytest.raises(ConfigError, match=r"is_causal=True disagrees with training_objective"):
        ModelConfig.from_dict({"training_objective": "masked", "is_causal": True})
    with pytest.raises(ConfigError, match=r"ffn_factor=0.3 × hidden_size=64 is no whole"):
        ModelConfig.from_dict({"hidden_size": 64, "ffn_factor": 0.3})


def test_the_registry_builds_the_seeds_mlp_from_config_fields():
    mlp = registry.create("mlp", "swiglu", hidden_size=768, ffn_factor=4)
    assert tuple(mlp.gate_proj.weight.shape) == (3072, 768)
    assert tuple(mlp.down_proj.weight.shape) == (768, 3072)
    sliced = registry.create("mlp", "gelu", hidden_size=64, intermediate_size=32)
    assert tuple(sliced.up_proj.weight.shape) == (32, 64)  # the constructor's own keyword
    built = registry.create("mlp", "swiglu", ModelConfig(hidden_size=32, intermediate_size=48))
    assert tuple(built.up_proj.weight.shape) == (48, 32)  # today's call, unchanged
    with pytest.raises(ConfigError, match=r"'ffn_factr': did you mean 'ffn_factor'"):
        registry.create("mlp", "swiglu", hidden_size=768, ffn_factr=4)
