"""Tier slices of a canonical state dict (docs/architecture.md, "Names, tiers, regions").

Layer ``i`` keeps FFN rows [:w_i] of ``gate_proj``/``up_proj`` and columns [:, :w_i] of
``down_proj``; every other tensor is shared by all tiers and kept whole. This is the one
place that knows which canonical tensors hold FFN neurons and along which axis
(``neuron_axis``): slicing narrows that axis, and ``neuron_order`` permutes it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

from torch import Tensor

# model.layers.{i}.mlp.{gate,up,down}_proj.{weight,bias} → (layer, projection, kind)
_FFN = re.compile(r"^model\.layers\.(\d+)\.mlp\.(gate_proj|up_proj|down_proj)\.(weight|bias)$")


def neuron_axis(name: str) -> tuple[int, int] | None:
    """(layer, axis of its FFN neurons) of a canonical tensor that has one, else None: rows of
    ``gate_proj`` and ``up_proj`` and their biases, columns of ``down_proj``. down_proj's bias
    lies on the hidden side, so it has none."""
    match = _FFN.match(name)
    if match is None:
        return None
    layer, projection, kind = int(match.group(1)), match.group(2), match.group(3)
    if projection == "down_proj":
        return None if kind == "bias" else (layer, 1)
    return layer, 0


def slice_state(state: dict[str, Tensor], widths: Sequence[int]) -> dict[str, Tensor]:
    """The canonical tensors of a model whose layer ``i`` has FFN width ``widths[i]``."""
    sliced = {}
    for name, tensor in state.items():
        found = neuron_axis(name)
        if found is not None:
            layer, axis = found
            tensor = tensor.narrow(axis, 0, widths[layer])
        sliced[name] = tensor
    return sliced


def sliced_parameters(shapes: Mapping[str, Sequence[int]], widths: Sequence[int]
                      ) -> tuple[int, int]:
    """(all parameters, FFN parameters) of the slice whose layer ``i`` has FFN width
    ``widths[i]``, counted from the universal canonical ``shapes`` without slicing anything."""
    total = ffn = 0
    for name, shape in shapes.items():
        count = math.prod(shape)
        found = neuron_axis(name)
        if found is not None:
            layer, axis = found
            count = count // shape[axis] * widths[layer]
            ffn += count
        total += count
    return total, ffn
