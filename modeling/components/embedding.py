"""Token embeddings, registered as embedding/token."""

from __future__ import annotations

from typing import Any

from torch import nn

from modeling.registry import registry


@registry.register("embedding", "token", "torch")
class TokenEmbedding(nn.Embedding):
    """A lookup table of one vector per token id (canonical ``embed_tokens.weight``)."""

    def __init__(self, config: Any, **_: Any) -> None:
        super().__init__(config.vocab_size, config.hidden_size)
        nn.init.normal_(self.weight, std=config.initializer_range)
