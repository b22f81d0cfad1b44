"""Error feedback: the client's momentum of one parameter, minus what it has sent.

Each round ``m ← β·m + lr·g``, ``sent = encode(m)``, ``m ← m − decode(sent)``: whatever the
encoding drops stays in ``m`` and is sent in later rounds, so over rounds the sum of what was
sent plus the residual ``m`` is the (decayed) sum of the inputs. With ``dense`` and β = 0,
``sent`` is exactly ``lr·g`` and ``m`` returns to exactly zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from matformer.modeling.compression.encodings import decode
from matformer.modeling.compression.grid import Region, region_shape
from matformer.modeling.compression.sparse import SparseResult
from matformer.modeling.errors import ResultShapeMismatch

if TYPE_CHECKING:
    from matformer.modeling.compression.compressor import Compressor


class ErrorFeedback:
    """Momentum (float32, or float64 for float64 dense results; shaped like the region) of
    one parameter on one client."""

    def __init__(
        self, compressor: Compressor, *, name: str, shape: tuple[int, ...], region: Region
    ) -> None:
        self.compressor = compressor
        self.name = name
        self.shape = shape
        self.region = region
        self.momentum = torch.zeros(region_shape(region), dtype=compressor.momentum_dtype)

    def step(self, grad: Tensor, tokens: int) -> SparseResult:
        """Fold this round's region-shaped gradient into the momentum and encode it."""
        if tuple(grad.shape) != tuple(self.momentum.shape):
            raise ResultShapeMismatch(
                f"{self.name}: gradient of shape {tuple(grad.shape)} does not match its region "
                f"{self.region}; slice it with region_slices(region) first."
            )
        momentum = self.momentum.to(grad.device)
        momentum.mul_(self.compressor.decay).add_(grad.detach(), alpha=self.compressor.lr)
        sent = self.compressor.encode(
            self.name, momentum, shape=self.shape, region=self.region, tokens=tokens
        )
        self.momentum = momentum.sub_(decode(sent))
        return sent
