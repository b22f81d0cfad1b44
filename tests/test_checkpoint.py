"""Checkpoint directories: Hugging Face interop, sharding, exact reload, tier export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.models import tiny_config

from matformer.modeling import AutoregressiveModel, BERTModel, TierError
from matformer.modeling.checkpoint import load_pretrained, save_pretrained
from matformer.modeling.checkpoint.export import export_tiers, read_manifest
from matformer.modeling.checkpoint.files import INDEX_NAME, WEIGHTS_NAME
from matformer.modeling.checkpoint.hf_config import from_config_dict, to_config_dict
from matformer.modeling.checkpoint.manifest import sha256_of
from matformer.modeling.errors import (
    AlreadySliced,
    CheckpointError,
    ConfigError,
    MissingShard,
    ShapeMismatch,
)
from matformer.scripts.export_matformer_tiers import main as export_main

transformers = pytest.importorskip("transformers")


def llama(**overrides) -> AutoregressiveModel:
    torch.manual_seed(0)
    return AutoregressiveModel(tiny_config(**overrides)).eval()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture
def ids():
    return torch.randint(0, 90, (2, 12))


@pytest.mark.parametrize("shard", [None, 8_000], ids=["single", "sharded"])
def test_universal_and_two_tier_slices_open_in_transformers_with_equal_logits(
        tmp_path, ids, shard):
    model = llama()
    source = save_pretrained(model, tmp_path / "tiny", max_shard_bytes=shard)
    assert (source / (INDEX_NAME if shard else WEIGHTS_NAME)).is_file()
    export_tiers(source, [1, 2])
    for tier in (0, 1, 2):
        directory = source if tier == 0 else source / f"tier{tier}"
        hf = transformers.LlamaForCausalLM.from_pretrained(directory).eval()
        assert hf.config.intermediate_size == 64 >> tier
        with torch.no_grad():
            assert max_diff(hf(ids).logits, model(ids, tier=tier)) <= 1e-4
            assert max_diff(load_pretrained(directory)(ids), model(ids, tier=tier)) <= 1e-6


@pytest.mark.parametrize(
    ("overrides", "cls"),
    [
        (dict(default_layer={"positional_encoding": "learnable", "normalization": "layernorm",
                             "ffn_activation": "gelu",
                             "hooks": {"post_mlp": {"name": "layer_scale", "init": 0.3}}}),
         AutoregressiveModel),
        (dict(is_causal=False, tie_word_embeddings=True,
              default_layer={"positional_encoding": "alibi", "normalization_position": "post"},
              layer_overrides={1: {"ffn_activation": "geglu"}}), BERTModel),
    ],
)
def test_other_shapes_save_their_layer_spec_and_reload_exactly(tmp_path, ids, overrides, cls):
    torch.manual_seed(0)
    model = cls(tiny_config(**overrides)).eval()
    save_pretrained(model, tmp_path / "m")
    saved = json.loads((tmp_path / "m" / "config.json").read_text())
    assert saved["model_type"] == "matformer"
    assert saved["default_layer"] == json.loads(json.dumps(model.config.to_dict()))[
        "default_layer"]
    loaded = load_pretrained(tmp_path / "m")
    assert type(loaded) is cls and loaded.config == model.config
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(),
                            strict=True):
        assert torch.equal(a, b), name
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


def test_tied_head_is_stored_once_and_restored(tmp_path):
    model = llama(tie_word_embeddings=True)
    save_pretrained(model, tmp_path / "tied")
    assert "lm_head.weight" not in load_file(tmp_path / "tied" / WEIGHTS_NAME)
    loaded = load_pretrained(tmp_path / "tied")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_plain_hugging_face_llama_checkpoint_loads(tmp_path, ids):
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_pretrained(tmp_path / "hf")
    assert ours.config.norm_eps == config.rms_norm_eps
    with torch.no_grad():
        assert max_diff(ours(ids), hf(ids).logits) <= 1e-4


def test_transformers_5_rope_theta_is_read_from_rope_parameters(tmp_path, ids):
    """transformers 5 writes rope_theta only inside rope_parameters; a Llama saved with
    500000 must not load with the default 10000 (issue 14, item 2)."""
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=500000.0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    if "rope_theta" not in written.get("rope_parameters", {}):
        pytest.skip("this transformers writes rope_theta at the top level")
    ours = load_pretrained(tmp_path / "hf")
    assert ours.config.rope_theta == 500000.0
    with torch.no_grad():
        assert max_diff(ours(ids), hf(ids).logits) <= 1e-4


def test_our_rope_theta_reaches_transformers(tmp_path, ids):
    model = llama(rope_theta=500000.0)
    save_pretrained(model, tmp_path / "ours")
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "ours").eval()
    with torch.no_grad():
        assert max_diff(hf(ids).logits, model(ids)) <= 1e-4
    assert load_pretrained(tmp_path / "ours").config.rope_theta == 500000.0


@pytest.mark.parametrize(
    ("extra", "message"),
    [({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
      "RoPE type 'linear'"),
     ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "factor": 2.0}},
      "with factor"),
     ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                           "partial_rotary_factor": 0.5}}, "partial_rotary_factor 0.5"),
     ({"partial_rotary_factor": 0.25}, "partial_rotary_factor 0.25"),
     ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}},
      "differ between layer types"),
     ({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
      "keep one value"),
     ({"attention_bias": True}, "attention_bias is true"),
     ({"mlp_bias": True}, "mlp_bias is true")],
)
def test_llama_fields_matformer_cannot_honour_are_refused(extra, message):
    data = {k: v for k, v in to_config_dict(tiny_config()).items() if k != "rope_parameters"}
    with pytest.raises(ConfigError, match=message):
        from_config_dict(data | extra)


def test_rope_parameters_per_layer_type_that_agree_are_read():
    data = to_config_dict(tiny_config()) | {"rope_theta": None, "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 250000.0}}}
    assert from_config_dict(data).rope_theta == 250000.0


def test_config_json_round_trip_and_errors():
    config = tiny_config()
    assert from_config_dict(to_config_dict(config)) == config
    data = to_config_dict(config) | {"transformers_version": "9.9", "use_cache": True}
    assert from_config_dict(data) == config
    with pytest.raises(ConfigError, match="did you mean 'hidden_size'"):
        from_config_dict(to_config_dict(config) | {"hiden_size": 3})
    with pytest.raises(ConfigError, match="'gpt2' model"):
        from_config_dict(to_config_dict(config) | {"model_type": "gpt2"})
    with pytest.raises(ConfigError, match="rope_scaling"):
        from_config_dict(to_config_dict(config) | {"rope_scaling": {"type": "linear"}})


def test_shape_disagreeing_with_config_is_named(tmp_path):
    save_pretrained(llama(), tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["num_key_value_heads"] = 4
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ShapeMismatch, match=r"k_proj.weight .* shape \(16, 32\).*\(32, 32\)"):
        load_pretrained(tmp_path / "m")


def test_index_naming_a_missing_shard_is_named(tmp_path):
    save_pretrained(llama(), tmp_path / "m", max_shard_bytes=8_000)
    index = json.loads((tmp_path / "m" / INDEX_NAME).read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    (tmp_path / "m" / shard).unlink()
    with pytest.raises(MissingShard, match=shard):
        load_pretrained(tmp_path / "m")


def test_no_weights_is_named(tmp_path):
    save_pretrained(llama(), tmp_path / "m")
    (tmp_path / "m" / WEIGHTS_NAME).unlink()
    with pytest.raises(CheckpointError, match="holds no weights"):
        load_pretrained(tmp_path / "m")


def test_export_writes_manifest_with_hashes_and_common_files(tmp_path, capsys):
    source = save_pretrained(llama(), tmp_path / "tiny", max_shard_bytes=8_000)
    (source / "tokenizer.json").write_text("{}")
    (source / "custom").mkdir()
    (source / "custom" / "modeling_extra.py").write_text("# user code\n")
    export_main(["--src", str(source), "--tiers", "1", "2"])
    said = capsys.readouterr().out  # where each slice went
    assert f"tier 1: intermediate_size 32, 9 files in {source / 'tier1'}\n" in said, said
    manifest = read_manifest(source)
    assert manifest.base_intermediate_size == 64
    assert manifest.common_files == ["custom/modeling_extra.py", "tokenizer.json"]
    assert manifest.available_tiers() == ["0", "1", "2"]
    tier1 = manifest.entry(1)
    assert tier1.intermediate_size == 32
    assert tier1.files[:2] == ["tier1/config.json", "tier1/" + INDEX_NAME]
    listed = [f for e in manifest.tiers for f in e.files] + manifest.common_files
    assert sorted(manifest.sha256) == sorted(listed)
    for name, digest in manifest.sha256.items():
        assert sha256_of((source / name).resolve()) == digest
    assert (source / "tier2" / "custom" / "modeling_extra.py").is_file()
    config = json.loads((source / "tier2" / "config.json").read_text())
    assert (config["matformer_tier"], config["matformer_base_intermediate_size"],
            config["intermediate_size"]) == (2, 64, 16)


def test_export_refuses_a_slice_and_bad_tiers_leaving_nothing(tmp_path, capsys):
    source = save_pretrained(llama(intermediate_size=96), tmp_path / "tiny")
    export_tiers(source, [1])
    with pytest.raises(AlreadySliced, match="already the tier 1 slice"):
        export_tiers(source / "tier1", [1])
    before = sorted(p.name for p in source.iterdir())
    with pytest.raises(TierError, match=r"96/2\*\*6 = 1\.5"):
        export_tiers(source, [2, 6])
    with pytest.raises(SystemExit) as exit_info:
        export_main(["--src", str(source), "--tiers", "6"])
    assert exit_info.value.code == 2 and "not a whole number" in capsys.readouterr().err
    assert sorted(p.name for p in source.iterdir()) == before


def test_failed_export_leaves_no_half_written_tier(tmp_path, monkeypatch):
    source = save_pretrained(llama(), tmp_path / "tiny")
    calls = []

    def failing_save(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) == 2:
            raise OSError("disk full")
        save_file(tensors, path, metadata=metadata)

    monkeypatch.setattr("matformer.modeling.checkpoint.files.save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        export_tiers(source, [1, 2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]
    assert sorted(p.name for p in source.iterdir()) == ["config.json", WEIGHTS_NAME]


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_optimizer_state_round_trips_without_pickle(tmp_path, name):
    from matformer.modeling.checkpoint.training_state import (
        load_training_state,
        save_training_state,
    )
    from matformer.modeling.optim import OptimizerConfig

    def run(model, optimizer, steps):
        for _ in range(steps):
            optimizer.zero_grad()
            model.loss(torch.arange(3, 15)[None]).backward()
            optimizer.step()

    model = llama()
    optimizer = OptimizerConfig(name=name, lr=1e-2, total_steps=10).build(model)
    run(model, optimizer, 3)
    save_pretrained(model, tmp_path / "ck")
    save_training_state(tmp_path / "ck", {"step": 3, "optimizer": optimizer.state_dict()})
    assert not list((tmp_path / "ck").glob("*.pt")) and not list((tmp_path / "ck").glob("*.bin"))

    resumed = load_pretrained(tmp_path / "ck")
    state = load_training_state(tmp_path / "ck")
    resumed_opt = OptimizerConfig(name=name, lr=1e-2, total_steps=10).build(resumed)
    resumed_opt.load_state_dict(state["optimizer"])
    assert state["step"] == 3
    run(model, optimizer, 2)
    run(resumed, resumed_opt, 2)
    for a, b in zip(model.state_dict().values(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b)
