"""MatFormer tiers: which FFN width each layer uses.

Tier ``t`` uses the first ``base / 2**t`` FFN neurons, where ``base`` is the universal
width (``matformer_base_intermediate_size``). Tiers are absolute: a checkpoint sliced at
tier 1 can run tiers 1, 2, ... but not tier 0, whose neurons it does not hold.
Mix'n'Match gives one tier per layer; width may shrink with depth but never grow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from matformer.modeling.errors import TierError

Tier = int | Sequence[int]  # one tier for every layer, or one per layer (Mix'n'Match)


def tier_width(config: Any, tier: int, stored_tier: int | None = None) -> int:
    """FFN width of ``tier``; raises TierError when it is not a whole number ≥ 1, or when
    the weights at hand (sliced at ``stored_tier``, default the checkpoint's) lack it."""
    base = config.matformer_base_intermediate_size
    if isinstance(tier, bool) or not isinstance(tier, int) or tier < 0:
        raise TierError(f"a tier is an integer >= 0, got {tier!r}.")
    width = base // 2 ** tier  # not >>: under torch.compile(dynamic=True) tier is symbolic,
    if width < 1 or width * 2 ** tier != base:  # and torch 2.11 cannot shift a symbol
        raise TierError(
            f"tier {tier} would use {base}/2**{tier} = {base / 2**tier:g} FFN neurons, which is "
            f"not a whole number >= 1; with base width {base} the deepest tier is "
            f"{_deepest_tier(base)}."
        )
    stored = config.matformer_tier if stored_tier is None else stored_tier
    if tier < stored:
        raise TierError(
            f"tier {tier} needs {width} FFN neurons but this checkpoint is the tier "
            f"{stored} slice ({base >> stored} neurons); load the universal checkpoint to run "
            "a larger tier."
        )
    return width


def layer_widths(config: Any, tier: Tier | None = None) -> list[int]:
    """The FFN width of every layer at ``tier`` (default: the checkpoint's own tier)."""
    layers = config.num_hidden_layers
    stored = config.stored_tiers()
    tiers = stored if tier is None else tier
    if not isinstance(tiers, Sequence):
        return [tier_width(config, tiers, s) for s in stored]
    tiers = list(tiers)
    if len(tiers) != layers:
        raise TierError(
            f"a Mix'n'Match tier list needs one tier per layer ({layers}), got {len(tiers)}."
        )
    for depth in range(1, layers):
        if tiers[depth] < tiers[depth - 1]:
            raise TierError(
                f"Mix'n'Match tiers {tiers} grow wider with depth at layer {depth} "
                f"(tier {tiers[depth - 1]} then {tiers[depth]}); a deeper layer must use the "
                "same or a higher tier."
            )
    return [tier_width(config, t, s) for t, s in zip(tiers, stored, strict=True)]


def tier_of_width(base: int, width: int) -> int:
    """The tier ``t`` with ``width == base / 2**t``; TierError when there is none."""
    ratio, rest = divmod(base, width) if width > 0 else (0, 1)
    if rest or ratio < 1 or ratio & (ratio - 1):
        raise TierError(
            f"intermediate_size {width} is not base {base} / 2**t for any tier t; set "
            "matformer_tier in config.json, or fix matformer_base_intermediate_size."
        )
    return ratio.bit_length() - 1


def tier_label(tier: Tier) -> str:
    """A stable name for a tier or Mix'n'Match list: "2", "mix:0,0,1,2"."""
    return str(tier) if isinstance(tier, int) else "mix:" + ",".join(map(str, tier))


# A run names its tiers by integer ids, on the wire and in its logs: an id below FIRST_MIX_ID is
# the integer tier itself, FIRST_MIX_ID + k the k-th Mix'n'Match slice the run declares.
FIRST_MIX_ID = 64
MAX_MIXES = 64  # slices one run declares at most


@dataclass(frozen=True, slots=True)
class TierIds:
    """A run's tier ids and what each stands for (``[tiers] layer_mixes``)."""

    mixes: tuple[tuple[int, ...], ...] = ()

    def resolve(self, tier: int) -> Tier:
        """The tier an id names: an integer tier, or one tier per layer."""
        if tier < FIRST_MIX_ID:
            return tier
        k = tier - FIRST_MIX_ID
        if k >= len(self.mixes):
            raise TierError(
                f"tier {tier} names Mix'n'Match slice {k} of the run, which declares "
                f"{len(self.mixes)} ([tiers] layer_mixes); ids {FIRST_MIX_ID} and up name them "
                "in order.")
        return list(self.mixes[k])

    def ids(self) -> list[int]:
        """The ids of the run's Mix'n'Match slices."""
        return [FIRST_MIX_ID + k for k in range(len(self.mixes))]

    def label(self, tier: int) -> str:
        """``tier_label`` of what the id names: "2", "mix:0,0,1,2"."""
        return tier_label(self.resolve(tier))

    def describe(self, tier: int) -> str:
        """"tier 2", or "tier 64 (mix:0,0,1,2)" for a slice."""
        return f"tier {tier}" if tier < FIRST_MIX_ID else f"tier {tier} ({self.label(tier)})"

    def within(self, tier: int, larger: int) -> bool:
        """Whether every layer of ``tier`` is as narrow as ``larger``'s or narrower (its
        neurons are a part of ``larger``'s)."""
        a, b = self.resolve(tier), self.resolve(larger)
        if isinstance(a, int) and isinstance(b, int):
            return a >= b
        layers = len(b) if isinstance(a, int) else len(a)
        a, b = ([t] * layers if isinstance(t, int) else t for t in (a, b))
        return len(a) == len(b) and all(x >= y for x, y in zip(a, b, strict=True))


NO_MIXES = TierIds()  # a run of integer tiers only


def _deepest_tier(base: int) -> int:
    tier = 0
    while base % 2 == 0 and base > 1:
        base //= 2
        tier += 1
    return tier
