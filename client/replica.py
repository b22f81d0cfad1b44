"""The client's replica of its tier slice, kept equal to the coordinator's master.

Weights never travel after the first load: each round the coordinator broadcasts its
``RoundUpdate`` (a step per canonical name, cut to the client's tier) and every client applies
the round's update rule to the region it holds (docs/architecture.md, "The update record").
The per-tier weight hash the coordinator publishes tells the client whether its replica still
agrees; on a mismatch the client reloads the latest checkpoint and replays the logged updates.

The replica holds whatever widths its model was built at (``config.stored_tiers()``): a tier
slice from ``load_for_tier``, or the universal model under the ``universal`` strategy.
"""

from __future__ import annotations

import torch
from torch import nn

from matformer.client.errors import ModelMismatch
from matformer.modeling.compression import (
    Region,
    RoundUpdate,
    tier_regions,
    universal_shapes,
    weight_hash,
)
from matformer.modeling.matformer import Tier
from matformer.modeling.naming import canonical_names, canonical_state_dict


class Replica:
    """A model at its stored widths, addressed by canonical names and universal regions."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.config = model.config
        self.shapes: dict[str, tuple[int, ...]] = universal_shapes(self.config)
        # what this replica holds of each universal tensor: its stored tier's regions
        self.regions: dict[str, Region] = tier_regions(
            self.shapes, self.config, self.config.stored_tiers()
        )
        names = canonical_names(model)
        # named_parameters drops tied duplicates: each tensor is updated once, under the
        # first canonical name; the other names (lm_head.weight when tied) are aliases.
        self.parameters: dict[str, nn.Parameter] = {
            names[key]: parameter for key, parameter in model.named_parameters()
        }
        self.aliases = frozenset(self.shapes) - frozenset(self.parameters)

    def apply(self, update: RoundUpdate) -> None:
        """Apply a round's broadcast ``update`` to the held slices."""
        unknown = sorted(set(update.steps) - set(self.parameters) - self.aliases)
        if unknown:
            raise ModelMismatch(
                "the update names parameters this replica does not hold: "
                f"{', '.join(unknown[:8])}; the server runs another model: rejoin so the "
                "schema hashes are compared."
            )
        rule = update.update.build()
        with torch.no_grad():
            for name, step in update.steps.items():
                if name in self.aliases:
                    continue
                parameter = self.parameters[name]
                if tuple(step.shape) != self.shapes[name]:
                    raise ModelMismatch(
                        f"the update of {name!r} has universal shape {list(step.shape)}, this "
                        f"replica's is {list(self.shapes[name])}; the server runs another "
                        "model: rejoin so the schema hashes are compared.")
                rule.apply(parameter, step, self.regions[name], out=parameter)  # in place

    def hash(self, tier: Tier | None = None) -> str:
        """``weight_hash`` of the replica at ``tier`` (default: all it holds), the digest the
        coordinator computes on its master for that tier."""
        regions = self.regions if tier is None else tier_regions(self.shapes, self.config, tier)
        return weight_hash(canonical_state_dict(self.model), regions)
