"""Hooks: modules a block calls at fixed points, registered as hook/<name>.

A hook maps the hidden states (B, T, C) to new hidden states of the same shape, is built
with the model config plus the params given in the layer config, and may own parameters,
which are trained with the model and saved in its checkpoints. Positions:

- ``pre_attn``: the residual stream entering the attention sublayer;
- ``pre_mlp``: the residual stream entering the MLP sublayer;
- ``post_mlp``: the MLP's output, before it is added to the residual stream;
- ``pre_output``: the block's output.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from matformer.modeling.registry import registry


@registry.register("hook", "layer_scale", "torch")
class LayerScale(nn.Module):
    """A learned per-channel gain (CaiT's LayerScale); put it at ``post_mlp``."""

    def __init__(self, config: Any, init: float = 1.0, **_: Any) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((config.hidden_size,), float(init)))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.scale
