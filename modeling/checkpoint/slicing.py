"""Tier slices of a canonical state dict (docs/architecture.md, "Names, tiers, regions").

Layer ``i`` keeps FFN rows [:w_i] of ``gate_proj``/``up_proj`` and columns [:, :w_i] of
``down_proj``; every other tensor is shared by all tiers and kept whole.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import Tensor

# model.layers.{i}.mlp.{gate,up,down}_proj.weight → (layer, which)
_FFN = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.weight$")


def slice_state(state: dict[str, Tensor], widths: Sequence[int]) -> dict[str, Tensor]:
    """The canonical tensors of a model whose layer ``i`` has FFN width ``widths[i]``."""
    sliced = {}
    for name, tensor in state.items():
        match = _FFN.match(name)
        if match:
            width = widths[int(match.group(1))]
            axis = 1 if match.group(2) == "down_proj" else 0
            tensor = tensor.narrow(axis, 0, width)
        sliced[name] = tensor
    return sliced

