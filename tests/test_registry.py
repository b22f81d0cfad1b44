"""Selection order, fallback, reporting and errors of the component registry."""

from __future__ import annotations

import logging

import pytest
from support.models import tiny_config

from matformer.modeling import AutoregressiveModel, Registry, RegistryError, registry
from matformer.modeling.components.kernels import SdpaAttention, TorchAttention


def make_registry() -> Registry:
    reg = Registry()
    for name, priority in [("slow", 0), ("fast", 10)]:
        reg.register("widget", "spin", name, priority=priority)(type(name, (), {}))
    reg.register("widget", "spin", "missing", priority=99, requires=["no_such_module_xyz"])(
        type("missing", (), {})
    )
    unavailable = type("broken", (), {"is_available": classmethod(lambda cls: False)})
    reg.register("widget", "spin", "broken", priority=50)(unavailable)
    return reg


def test_highest_available_priority_wins_and_unavailable_are_skipped():
    assert make_registry().select("widget", "spin").name == "fast"


def test_config_request_then_preferences_then_environment(monkeypatch):
    reg = make_registry()
    assert reg.select("widget", "spin", requested="slow").name == "slow"
    reg.set_preferences({"widget": {"spin": "fast"}})
    assert reg.select("widget", "spin", requested="slow").name == "fast"
    monkeypatch.setenv("MATFORMER_WIDGET_SPIN", "slow")
    assert reg.select("widget", "spin", requested="fast").name == "slow"


def test_unavailable_choice_falls_back_and_says_so_once(caplog):
    reg = make_registry()
    with caplog.at_level(logging.WARNING, logger="matformer.registry"):
        for _ in range(3):
            assert reg.select("widget", "spin", requested="missing").name == "fast"
        assert reg.select("widget", "spin", requested="broken").name == "fast"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "'missing'" in lines[0] and "no_such_module_xyz" in lines[0] and "'fast'" in lines[0]
    assert "is_available" in lines[1]


def test_environment_override_of_unavailable_name_falls_back(monkeypatch):
    reg = make_registry()
    monkeypatch.setenv("MATFORMER_WIDGET_SPIN", "missing")
    assert reg.select("widget", "spin").name == "fast"


@pytest.mark.parametrize(
    ("call", "expected"),
    [
        (lambda r: r.select("gadget", "spin"), ["unknown registry category 'gadget'", "widget"]),
        (lambda r: r.select("widget", "spn"), ["did you mean 'spin'", "registered: spin"]),
        (lambda r: r.select("widget", "spin", "fsat"),
         ["did you mean 'fast'", "broken, fast, missing, slow"]),
        (lambda r: r.set_preferences({"widget": {"spin": "nope"}}), ["'nope'", "fast"]),
    ],
)
def test_unknown_names_list_what_exists(call, expected):
    with pytest.raises(RegistryError) as err:
        call(make_registry())
    for text in expected:
        assert text in str(err.value)


def test_nothing_available_is_an_error():
    reg = Registry()
    reg.register("widget", "spin", "missing", requires=["no_such_module_xyz"])(type("m", (), {}))
    with pytest.raises(RegistryError, match="no implementation of widget/spin can run here"):
        reg.select("widget", "spin")


def test_builtin_categories_are_registered():
    assert {"attention", "block", "embedding", "hook", "loss", "mlp", "norm", "positional"} <= set(
        registry.categories()
    )
    assert {"alibi", "learnable", "nope", "rope", "sinusoidal"} <= set(
        registry.variants("positional"))
    assert {"geglu", "gelu", "swiglu"} <= set(registry.variants("mlp"))
    names = [impl.name for impl in registry.implementations("attention", "kernel")]
    assert names == ["sdpa", "flash", "flex", "torch", "wersa"]


def test_default_kernel_is_sdpa_and_flash_falls_back_on_cpu(caplog, monkeypatch):
    model = AutoregressiveModel(tiny_config())
    assert isinstance(model.model.layers[0].self_attn.kernel, SdpaAttention)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="matformer.registry"):
        flash = AutoregressiveModel(tiny_config(default_layer={"attn_impl": "flash"}))
    assert type(flash.model.layers[0].self_attn.kernel) is SdpaAttention
    assert sum("'flash'" in r.getMessage() for r in caplog.records) <= 1


def test_environment_override_reaches_the_model(monkeypatch):
    monkeypatch.setenv("MATFORMER_ATTENTION_KERNEL", "torch")
    model = AutoregressiveModel(tiny_config(default_layer={"attn_impl": "sdpa"}))
    assert all(isinstance(layer.self_attn.kernel, TorchAttention) for layer in model.model.layers)
