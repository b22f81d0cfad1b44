"""Training memory of one tier at a token budget: what the tier policy compares with the
memory a client reports. Simple and on the high side, everything in fp32 (4 bytes)::

    bytes(t, T) = 16 · N_t                                       state
                + 4 · T · (Σ_l (8·C + 4·w_t,l) + 2·C + 2·V)    activations kept for backward

- ``N_t``: parameters tier ``t`` trains: every non-FFN parameter whole (they are shared by
  all tiers; a tied ``lm_head`` counts apart, as the wire carries it), ``gate``/``up``/``down``
  at width ``w_t,l`` in layer ``l`` (one width for a tier, one per layer for a
  Mix'n'Match slice: ``[tiers] layer_mixes``). Four fp32 copies each: the weights, their
  gradients, the error-feedback momentum, and one working copy (the encode/decode and
  update temporaries; the size of Adam's second moment in a standalone run).
- ``T``: tokens per microbatch; ``L`` layers, ``C`` hidden size, ``V`` vocabulary.
- Per layer and token: ``8·C`` for the two norm inputs and outputs, q, k, v (k and v counted
  at full width, whatever the grouping) and the attention output; ``4·w_t,l`` for the FFN's gate,
  up, activation and product. Attention scores are not counted: the sdpa and flash kernels
  never store the ``S × S`` matrix.
- Per token outside the layers: ``2·C`` for the final norm's input and output, ``2·V`` for
  the logits and their gradient.
"""

from __future__ import annotations

import math

from matformer.modeling.compression import (
    region_shape,
    tier_regions,
    universal_config,
    universal_shapes,
)
from matformer.modeling.config import ModelConfig
from matformer.modeling.matformer import NO_MIXES, TierIds, layer_widths

FP32 = 4
STATE_COPIES = 4  # weights, gradients, error-feedback momentum, one working copy
HIDDEN_PER_LAYER = 8  # hidden-sized activations per layer and token
FFN_PER_LAYER = 4  # FFN-width activations per layer and token


class TrainingMemory:
    """Estimates for one model; its universal shapes are read once (on the meta device)."""

    def __init__(self, config: ModelConfig, tier_ids: TierIds = NO_MIXES) -> None:
        self.config = universal_config(config)
        self.tier_ids = tier_ids
        self._shapes = universal_shapes(self.config)
        self._parameters: dict[int, int] = {}

    def parameters(self, tier: int) -> int:
        """``N_t``: the parameters tier ``tier`` trains."""
        if tier not in self._parameters:
            regions = tier_regions(self._shapes, self.config, self.tier_ids.resolve(tier))
            self._parameters[tier] = sum(math.prod(region_shape(r)) for r in regions.values())
        return self._parameters[tier]

    def widths(self, tier: int) -> list[int]:
        """The FFN width of each layer at ``tier``."""
        return layer_widths(self.config, self.tier_ids.resolve(tier))

    def training_bytes(self, tier: int, tokens: int) -> int:
        """Estimated bytes to train ``tier`` with microbatches of ``tokens`` tokens."""
        c, v = self.config.hidden_size, self.config.vocab_size
        layers = self.config.num_hidden_layers
        per_token = (layers * HIDDEN_PER_LAYER * c + FFN_PER_LAYER * sum(self.widths(tier))
                     + 2 * c + 2 * v)
        return FP32 * (STATE_COPIES * self.parameters(tier) + tokens * per_token)
