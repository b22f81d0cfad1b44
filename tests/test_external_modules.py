"""A user's own components, registered from a folder, used through the config alone."""

from __future__ import annotations

import textwrap

import pytest
import torch
from support.models import tiny_config

from matformer.modeling import AutoregressiveModel, RegistryError, canonical_state_dict, registry

USER_MODULE = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from torch import nn

    from matformer.modeling import registry


    @registry.register("hook", "{prefix}_gate", "default")
    class TanhGate(nn.Module):
        """A trainable gate on the residual stream."""

        def __init__(self, config, init=0.5, **_):
            super().__init__()
            self.alpha = nn.Parameter(torch.full((config.hidden_size,), float(init)))

        def forward(self, x):
            return x * (1 + torch.tanh(self.alpha))


    @registry.register("mlp", "{prefix}_relu2", "custom",
                       params_names={{"w_in.weight": "up_proj.weight",
                                     "w_out.weight": "down_proj.weight"}})
    class SquaredReLU(nn.Module):
        """An FFN whose own tensor names differ from the canonical ones."""

        def __init__(self, config, **_):
            super().__init__()
            self.w_in = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
            self.w_out = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

        def forward(self, x, width):
            hidden = F.relu(F.linear(x, self.w_in.weight[:width])) ** 2
            return F.linear(hidden, self.w_out.weight[:, :width])
''')


def write_modules(folder, prefix: str):
    folder.mkdir()
    (folder / "my_components.py").write_text(USER_MODULE.format(prefix=prefix))
    return folder


def test_external_folder_from_config(tmp_path):
    folder = write_modules(tmp_path / "user_modules", "cfg")
    config = tiny_config(
        external_modules_path=str(folder),
        default_layer={"ffn_activation": "cfg_relu2",
                       "hooks": {"pre_mlp": {"name": "cfg_gate", "init": 0.25}}},
    )
    model = AutoregressiveModel(config)
    gate = model.model.layers[0].hooks["pre_mlp"]
    assert torch.allclose(gate.alpha, torch.full((32,), 0.25))

    names = canonical_state_dict(model)
    assert "model.layers.0.mlp.up_proj.weight" in names
    assert "model.layers.0.mlp.down_proj.weight" in names
    assert "model.layers.0.mlp.w_in.weight" not in names
    assert "model.layers.1.hooks.pre_mlp.alpha" in names

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = gate.alpha.detach().clone()
    model.loss(torch.randint(0, 90, (2, 12))).backward()
    assert torch.count_nonzero(gate.alpha.grad) > 0
    optimizer.step()
    assert not torch.equal(before, gate.alpha)
    # the trained hook travels with the weights: a fresh model loads it back exactly
    fresh = AutoregressiveModel(config)
    fresh.load_state_dict(model.state_dict())
    assert torch.equal(fresh.model.layers[0].hooks["pre_mlp"].alpha, gate.alpha)


def test_external_folder_from_environment(tmp_path, monkeypatch):
    folder = write_modules(tmp_path / "env_modules", "env")
    monkeypatch.setenv("MATFORMER_MODULES_PATH", str(folder))
    model = AutoregressiveModel(tiny_config(default_layer={"hooks": {"pre_output": "env_gate"}}))
    assert type(model.model.layers[1].hooks["pre_output"]).__name__ == "TanhGate"
    assert registry.select("mlp", "env_relu2").name == "custom"


def test_missing_external_folder_is_a_clear_error(tmp_path):
    with pytest.raises(RegistryError, match=r"external modules folder .* does not exist"):
        AutoregressiveModel(tiny_config(external_modules_path=str(tmp_path / "nowhere")))


def test_builtin_trainable_hook():
    model = AutoregressiveModel(tiny_config(
        default_layer={"hooks": {"post_mlp": {"name": "layer_scale", "init": 0.1}}}))
    scale = model.model.layers[0].hooks["post_mlp"].scale
    assert torch.allclose(scale, torch.full((32,), 0.1))
    model.loss(torch.randint(0, 90, (2, 8))).backward()
    assert torch.count_nonzero(scale.grad) > 0
    assert "model.layers.0.hooks.post_mlp.scale" in model.state_dict()
