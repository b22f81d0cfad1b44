"""The keys and values a generating model keeps per attention layer (a KV cache).

Each new token then costs one position of work per layer instead of the whole sequence
again. The cache belongs to one sequence being generated: ``NakedTransformer.forward``
takes it, every attention layer appends its new keys and values, and the next call sees
them. Only whole prompts (no cached positions yet) or one new token at a time go through
a cache: that is all generation needs, and it keeps the causal mask trivial.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from matformer.modeling.errors import BatchError


class KVCache:
    def __init__(self) -> None:
        self._layers: dict[int, tuple[Tensor, Tensor]] = {}  # id(attention) → (k, v)
        self.length = 0  # positions cached (the same in every layer after each forward)

    def extend(self, layer: nn.Module, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, int]:
        """(all keys, all values, positions cached before) of ``layer`` with ``k``, ``v``
        (B, Hkv, T, D) appended."""
        past = self._layers.get(id(layer))
        before = 0 if past is None else past[0].shape[2]
        if before and k.shape[2] != 1:
            raise BatchError(f"a KV cache takes one new position at a time once it holds "
                             f"some; got {k.shape[2]} after {before}.")
        if past is not None:
            k, v = torch.cat((past[0], k), dim=2), torch.cat((past[1], v), dim=2)
        self._layers[id(layer)] = (k, v)
        self.length = k.shape[2]
        return k, v, before
