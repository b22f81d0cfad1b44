"""The client's replica of its tier slice, kept equal to the coordinator's master.

Weights never travel after the first load: each round the coordinator broadcasts its
``RoundUpdate`` (a step per canonical name, cut to the client's tier) and every client applies
the round's update rule to the region it holds (docs/architecture.md, "The update record").
The per-tier weight hash the coordinator publishes tells the client whether its replica still
agrees; on a mismatch the caller reloads (``resynchronise``) and replays the logged updates.

The replica holds whatever widths its model was built at (``config.stored_tiers()``): a tier
slice from ``load_for_tier``, or the universal model under the ``universal`` strategy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from client.errors import UnknownParameter
from modeling.compression import (
    Region,
    RoundUpdate,
    region_slices,
    tier_regions,
    universal_shapes,
    weight_hash,
)
from modeling.matformer import Tier
from modeling.naming import canonical_names, canonical_state_dict


@dataclass(frozen=True, slots=True)
class HashCheck:
    """The replica's hash against the one the coordinator published for the same tier."""

    local: str
    published: str

    @property
    def matches(self) -> bool:
        return self.local == self.published


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
            raise UnknownParameter(
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
                    raise UnknownParameter(
                        f"the update of {name!r} has universal shape {list(step.shape)}, this "
                        f"replica's is {list(self.shapes[name])}; the server runs another "
                        "model: rejoin so the schema hashes are compared.")
                parameter.copy_(rule.apply(parameter, step, self.regions[name]))

    def hash(self, tier: Tier | None = None) -> str:
        """``weight_hash`` of the replica at ``tier`` (default: all it holds), the digest the
        coordinator computes on its master for that tier."""
        regions = self.regions if tier is None else tier_regions(self.shapes, self.config, tier)
        return weight_hash(canonical_state_dict(self.model), regions)

    def check(self, published: str, tier: Tier | None = None) -> HashCheck:
        """Compare with the coordinator's published hash; on a mismatch, resynchronise."""
        return HashCheck(local=self.hash(tier), published=published)

    def resynchronise(self, state: Mapping[str, Tensor]) -> None:
        """Overwrite the held weights from a canonical ``state`` (universal or any slice at
        least as wide as the replica), e.g. a freshly loaded checkpoint."""
        missing = sorted(set(self.parameters) - set(state))
        if missing:
            raise UnknownParameter(
                f"the state lacks parameters this replica holds: {', '.join(missing[:8])}; "
                "load a checkpoint of the same model."
            )
        with torch.no_grad():
            for name, parameter in self.parameters.items():
                parameter.copy_(state[name][region_slices(self.regions[name])])
