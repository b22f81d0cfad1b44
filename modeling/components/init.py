"""Weight initialisation shared by the built-in components."""

from typing import Any

from torch import nn


def linear(config: Any, in_features: int, out_features: int) -> nn.Linear:
    """A bias-free linear layer with N(0, initializer_range) weights, as Llama has."""
    layer = nn.Linear(in_features, out_features, bias=False)
    nn.init.normal_(layer.weight, std=config.initializer_range)
    return layer
