"""Normalisations, registered as norm/<variant>; the weight is canonical ``weight``."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from matformer.modeling.registry import registry


@registry.register("norm", "rmsnorm", "torch")
class RMSNorm(nn.Module):
    """x / rms(x) · weight, computed in fp32 as Llama does."""

    def __init__(self, config: Any, **_: Any) -> None:
        super().__init__()
        self.eps = config.norm_eps
        self.weight = nn.Parameter(torch.ones(config.hidden_size))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


@registry.register("norm", "layernorm", "torch")
class LayerNorm(nn.LayerNorm):
    """Standard LayerNorm with a learned weight and bias."""

    def __init__(self, config: Any, **_: Any) -> None:
        super().__init__(config.hidden_size, eps=config.norm_eps)
