"""Weight initialisation shared by the built-in components."""

from typing import Any

from torch import Tensor, nn


def normal(weight: Tensor, std: float) -> None:
    """N(0, std) in place. Not on the meta device, where there are no values to draw: there
    torch's ``normal_`` imports its compiler, some 2 s the first time in a process, and shapes
    (all a meta model is built for) need no values."""
    if weight.device.type != "meta":
        nn.init.normal_(weight, std=std)


def linear(config: Any, in_features: int, out_features: int) -> nn.Linear:
    """A bias-free linear layer with N(0, initializer_range) weights, as Llama has."""
    layer = nn.Linear(in_features, out_features, bias=False)
    normal(layer.weight, config.initializer_range)
    return layer
