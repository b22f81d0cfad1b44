"""Training losses, registered as loss/<variant>."""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from matformer.modeling.registry import registry

IGNORE_INDEX = -100  # label of positions that carry no loss (padding, unmasked tokens)


@registry.register("loss", "cross_entropy", "torch")
class CrossEntropy(nn.Module):
    """Token cross-entropy over labels that are not IGNORE_INDEX, computed in fp32."""

    def __init__(self, config: Any = None, **_: Any) -> None:
        super().__init__()

    def forward(self, logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
        """``reduction`` "sum" lets microbatches divide by the whole batch's target count."""
        # logits (B, T, V), labels (B, T)
        return F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
            reduction=reduction,
        )
