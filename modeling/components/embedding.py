"""Token embeddings, registered as embedding/token."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from matformer.modeling.components.init import normal
from matformer.modeling.registry import registry


@registry.register("embedding", "token", "torch")
class TokenEmbedding(nn.Embedding):
    """A lookup table of one vector per token id (canonical ``embed_tokens.weight``)."""

    def __init__(self, config: Any, **_: Any) -> None:
        # Given a weight, nn.Embedding skips its own N(0, 1) draw; that draw is made here but
        # on the meta device (see ``normal``), so a seed gives the weights it always gave.
        super().__init__(config.vocab_size, config.hidden_size,
                         _weight=torch.empty(config.vocab_size, config.hidden_size))
        if self.weight.device.type != "meta":
            self.reset_parameters()
        normal(self.weight, config.initializer_range)
