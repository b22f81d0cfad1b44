"""Nested (MatFormer) feed-forward blocks, registered as mlp/<activation>.

``forward(x, width)`` uses only the first ``width`` FFN neurons: rows [:width] of
gate_proj/up_proj and columns [:, :width] of down_proj, taken with ``narrow`` so they are
views of the universal weights. Gradients reach the shared prefix; the tail gets exactly 0.
``intermediate_size`` overrides the config's for one layer (Mix'n'Match slices).
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from matformer.modeling.components.init import linear
from matformer.modeling.registry import registry


def prefix(weight: Tensor, dim: int, width: int) -> Tensor:
    """The first ``width`` entries of ``weight`` along ``dim``, as a view.

    At full width the weight itself is used: a narrow view would cost a zero-fill and copy of
    the gradient in backward for nothing. A weight split by tensor parallelism (a DTensor)
    is narrowed on each rank's own shard instead (modeling/tensor_parallel.py).
    """
    if width == weight.shape[dim]:
        return weight
    if hasattr(weight, "device_mesh"):  # imported here: torch.distributed only when in use
        from matformer.modeling.tensor_parallel import local_prefix

        return local_prefix(weight, dim, width)
    return weight.narrow(dim, 0, width)


class FFNDropout(nn.Module):
    """The FFN's dropout on its hidden activations (``ffn_dropout``), applied while training."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.ffn_dropout = getattr(config, "ffn_dropout", 0.0)

    def dropped(self, hidden: Tensor) -> Tensor:
        if self.training and self.ffn_dropout:
            return F.dropout(hidden, self.ffn_dropout)
        return hidden


class GatedMLP(FFNDropout):
    """down(act(gate(x)) · up(x)); subclasses choose the activation."""

    def __init__(self, config: Any, intermediate_size: int | None = None, **_: Any) -> None:
        super().__init__(config)
        hidden, inner = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_proj = linear(config, hidden, inner)
        self.up_proj = linear(config, hidden, inner)
        self.down_proj = linear(config, inner, hidden)

    def activation(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor, width: int) -> Tensor:
        gate = F.linear(x, prefix(self.gate_proj.weight, 0, width))  # (B, T, width)
        up = F.linear(x, prefix(self.up_proj.weight, 0, width))
        hidden = self.dropped(self.activation(gate) * up)
        return F.linear(hidden, prefix(self.down_proj.weight, 1, width))


@registry.register("mlp", "swiglu", "torch")
class SwiGLU(GatedMLP):
    def activation(self, x: Tensor) -> Tensor:
        return F.silu(x)


@registry.register("mlp", "geglu", "torch")
class GeGLU(GatedMLP):
    def activation(self, x: Tensor) -> Tensor:
        return F.gelu(x)


@registry.register("mlp", "gelu", "torch")
class GeluMLP(FFNDropout):
    """down(gelu(up(x))): the classic two-matrix FFN."""

    def __init__(self, config: Any, intermediate_size: int | None = None, **_: Any) -> None:
        super().__init__(config)
        inner = intermediate_size or config.intermediate_size
        self.up_proj = linear(config, config.hidden_size, inner)
        self.down_proj = linear(config, inner, config.hidden_size)

    def forward(self, x: Tensor, width: int) -> Tensor:
        hidden = F.gelu(F.linear(x, prefix(self.up_proj.weight, 0, width)))  # (B, T, width)
        return F.linear(self.dropped(hidden), prefix(self.down_proj.weight, 1, width))
