"""ModuleSpec names its class directly or by import path, as Megatron's does."""

from __future__ import annotations

import textwrap

import pytest
import torch
from support.models import tiny_config
from torch import nn

from matformer.modeling.components.norms import RMSNorm
from matformer.modeling.errors import ConfigError
from matformer.modeling.spec import ModuleSpec, build_module


@pytest.mark.parametrize("module", [
    RMSNorm, "matformer.modeling.components.norms.RMSNorm",
    ("matformer.modeling.components.norms", "RMSNorm"),
], ids=["class", "dotted", "tuple"])
def test_a_path_builds_what_the_class_builds(module):
    config = tiny_config()
    built = build_module(ModuleSpec(module), config=config)
    assert type(built) is RMSNorm
    x = torch.randn(2, 5, config.hidden_size)
    assert torch.equal(built(x), RMSNorm(config)(x))


def test_a_users_class_on_the_path_is_imported_when_the_spec_is_built(tmp_path, monkeypatch):
    (tmp_path / "my_layers.py").write_text(textwrap.dedent("""
        from torch import nn

        class Scaled(nn.Module):
            def __init__(self, config, factor=1.0, submodules=None, **_):
                super().__init__()
                self.factor = factor
                self.inner = submodules

            def forward(self, x):
                return self.factor * x
    """))
    spec = ModuleSpec("my_layers.Scaled", params={"factor": 3.0}, submodules="kept")
    monkeypatch.syspath_prepend(str(tmp_path))  # importable only now: resolved on build
    built = build_module(spec, config=tiny_config())
    assert (built.factor, built.inner) == (3.0, "kept")
    assert torch.equal(built(torch.ones(2)), torch.full((2,), 3.0))


@pytest.mark.parametrize("module, message", [
    ("no_such_package.layers.Block", r"cannot import 'no_such_package.layers'"),
    ("matformer.modeling.components.norms.RMSNrom", r"has no 'RMSNrom'; did you mean 'RMSNorm'"),
    ("matformer.modeling.components.norms.registry", r"is Registry .* not a torch.nn.Module class"),
    ("RMSNorm", r"give a class, 'package.module.Class' or \('package.module', 'Class'\)"),
    (("matformer.modeling.components.norms",), r"give a class"),
])
def test_a_path_that_leads_nowhere_is_named(module, message):
    with pytest.raises(ConfigError, match=message):
        build_module(ModuleSpec(module), config=tiny_config())


def test_nested_specs_resolve_their_own_paths():
    class Pair(nn.Module):
        def __init__(self, config, submodules):
            super().__init__()
            self.first = build_module(submodules[0], config=config)
            self.second = build_module(submodules[1], config=config)

    built = build_module(ModuleSpec(Pair, submodules=(
        ModuleSpec("matformer.modeling.components.norms.LayerNorm"),
        ModuleSpec(("matformer.modeling.components.norms", "RMSNorm")))), config=tiny_config())
    assert [type(m).__name__ for m in (built.first, built.second)] == ["LayerNorm", "RMSNorm"]
