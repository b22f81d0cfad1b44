"""Bad configs fail with named, actionable errors before any tensor is allocated."""

from __future__ import annotations

import json

import pytest
import torch
from support.models import tiny_config

from matformer.modeling import (
    AutoregressiveModel,
    ConfigError,
    HookPositionError,
    ModelConfig,
    RegistryError,
    TierError,
)
from matformer.modeling.config import LayerConfig


@pytest.fixture
def no_allocation(monkeypatch):
    """Fail the test if a parameter tensor is created."""
    def refuse(*args, **kwargs):
        raise AssertionError("a parameter was allocated before the config was checked")
    monkeypatch.setattr(torch.nn.Parameter, "__new__", refuse)


@pytest.mark.parametrize(
    ("build", "error", "message"),
    [
        (lambda: ModelConfig.from_dict({"hiden_size": 64}), ConfigError,
         "unknown model config key 'hiden_size': did you mean 'hidden_size'"),
        (lambda: ModelConfig.from_dict({"default_layer": {"normalisation": "rmsnorm"}}),
         ConfigError, "did you mean 'normalization'"),
        (lambda: tiny_config(hidden_size=30, num_attention_heads=4), ConfigError,
         "num_attention_heads=4 does not divide hidden_size=30"),
        (lambda: tiny_config(num_key_value_heads=3), ConfigError, "must divide"),
        (lambda: tiny_config(intermediate_size=48, matformer_tier=1,
                             matformer_base_intermediate_size=64),
         ConfigError, "not matformer_base_intermediate_size=64 / 2\\*\\*matformer_tier"),
        (lambda: tiny_config(default_layer={"hooks": {"post_attn": "layer_scale"}}),
         HookPositionError, "'post_attn' does not exist.*pre_attn, pre_mlp, post_mlp"),
        (lambda: tiny_config(layer_overrides={"5": {"attn_impl": "torch"}}), ConfigError,
         "layer 5.*layers 0..1"),
        (lambda: tiny_config(layer_overrides={"1": {"positional_encoding": "alibi"}}),
         ConfigError, "once per model"),
        (lambda: tiny_config(mask_token_id=500), ConfigError, "outside the vocabulary"),
    ],
)
def test_bad_config_is_a_named_error(build, error, message, no_allocation):
    with pytest.raises(error, match=message):
        AutoregressiveModel(build())


@pytest.mark.parametrize(
    ("layer", "message"),
    [
        ({"normalization": "batchnorm"}, "unknown norm variant 'batchnorm'.*layernorm, rmsnorm"),
        ({"ffn_activation": "swiglu2"}, "did you mean 'swiglu'"),
        ({"positional_encoding": "rotary"}, "unknown positional variant 'rotary'"),
        ({"attn_impl": "sdpa2"}, "did you mean 'sdpa'"),
        ({"hooks": {"pre_mlp": "no_such_hook"}}, "unknown hook variant 'no_such_hook'"),
        ({"normalization_position": "middle"}, "unknown block variant 'middle'.*post, pre"),
    ],
)
def test_unknown_component_fails_before_allocation(layer, message, no_allocation):
    with pytest.raises(RegistryError, match=message):
        AutoregressiveModel(tiny_config(default_layer=layer))


def test_bad_tier_fails_before_any_compute(no_allocation):
    config = tiny_config()
    with pytest.raises(TierError):
        from matformer.modeling import layer_widths
        layer_widths(config, 9)


def test_config_round_trips_through_json(tmp_path):
    config = tiny_config(
        default_layer={"normalization": "layernorm", "hooks": {"post_mlp": {"name": "layer_scale",
                                                                            "init": 0.1}}},
        layer_overrides={1: {"attn_impl": "torch", "ffn_activation": "gelu"}},
    )
    path = tmp_path / "config.json"
    config.to_json(path)
    loaded = ModelConfig.from_json(path)
    assert loaded == config
    assert json.loads(path.read_text())["layer_overrides"] == {
        "1": {"attn_impl": "torch", "ffn_activation": "gelu"}}
    assert loaded.layer_configs()[1] == LayerConfig(
        normalization="layernorm", attn_impl="torch", ffn_activation="gelu",
        hooks={"post_mlp": {"name": "layer_scale", "init": 0.1}})


def test_per_layer_overrides_build_different_components():
    model = AutoregressiveModel(tiny_config(
        layer_overrides={1: {"ffn_activation": "gelu", "normalization": "layernorm"}}))
    first, second = model.model.layers
    assert hasattr(first.mlp, "gate_proj") and not hasattr(second.mlp, "gate_proj")
    assert "model.layers.1.input_layernorm.bias" in model.state_dict()
    assert "model.layers.0.input_layernorm.bias" not in model.state_dict()


def test_invalid_json_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match=r"broken\.json is not valid JSON"):
        ModelConfig.from_json(path)
