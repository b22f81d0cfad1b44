"""Which tier a joining client trains, and why.

Rules, in order:

1. A pin (``[tiers.pins]``, by client name) decides, whatever the client asked for; a pinned
   tier that does not fit the client's memory is refused (``PinnedTierDoesNotFit``).
2. Otherwise the candidates are the run's tiers no larger than the one the client asked
   for: asking for tier ``t`` means "at most as big as tier ``t``", i.e. tier index ``>= t``
   (a Mix'n'Match slice, ``[tiers] layer_mixes``: ``>= t`` on every layer).
3. Of the candidates, those whose estimated training memory (``server.memory``) at the
   client's microbatch token budget fits the memory it reports.
4. Without a target mix: the largest model that fits (most parameters). With one
   (``[tiers.mix]``): the fitting tier whose share of the current members is furthest below
   its target (a tier the mix leaves out has target 0); ties go to the larger model.

The reason of every assignment is a sentence for the client and the log, e.g.
"tier 1 (FFN 512): tier 0 needs 3.1 GiB, the client reports 2.0 GiB".
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from matformer.modeling.config import ModelConfig
from matformer.modeling.matformer import FIRST_MIX_ID, MAX_MIXES, NO_MIXES, TierIds
from matformer.server.errors import BadCapabilities, NoAllowedTier, NoTierFits, PinnedTierDoesNotFit
from matformer.server.memory import TrainingMemory


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a joining client reports about itself."""

    name: str  # human-readable; [tiers.pins] matches it
    device_kind: str  # cpu | cuda | mps
    memory_bytes: int  # memory it can train in
    requested_tier: int | None  # the largest model it wants (smallest index); None: any
    tokens_per_second: float  # measured on a warm-up; sizes its share of a round
    microbatch_tokens: int  # tokens per forward/backward pass
    device_name: str = ""  # e.g. "NVIDIA H100 80GB HBM3" or the CPU model; shown to operators
    relay: bool = False  # a relay: it submits the partial sums of members behind it


@dataclass(frozen=True, slots=True)
class TierAssignment:
    tier: int
    ffn_width: int
    estimated_bytes: int  # training memory at the client's microbatch token budget
    reason: str  # one sentence: why this tier


class TierPolicy:
    """The run's tier rules over one model; built by ``TiersSection.build(model)``."""

    def __init__(self, model: ModelConfig, *, allowed: Sequence[int],
                 pins: Mapping[str, int], mix: Mapping[int, float],
                 tier_ids: TierIds = NO_MIXES) -> None:
        self.memory = TrainingMemory(model, tier_ids)
        self.ids = tier_ids
        # largest first: a move is one place along this list
        self.allowed = sorted(allowed, key=lambda t: (-self.memory.parameters(t), t))
        self.pins = dict(pins)
        self.mix = dict(mix)

    def moved(self, *, name: str, tier: int, step: int, requested_tier: int | None,
              memory_bytes: int, microbatch_tokens: int) -> int | None:
        """The allowed tier one step smaller (``step`` +1) or larger (-1) than ``tier`` for a
        member that is not pinned, when its request and memory allow (``memory_bytes`` 0:
        unknown); None when it stays."""
        if name in self.pins or tier not in self.allowed:
            return None
        here = self.allowed.index(tier) + step
        if not 0 <= here < len(self.allowed):
            return None
        moved = self.allowed[here]
        if step < 0:
            need = self.memory.training_bytes(moved, microbatch_tokens)
            if not self.ids.within(moved, requested_tier or 0) or (
                    memory_bytes and need > memory_bytes):
                return None
        return moved

    def assign(self, client: Capabilities, members: Sequence[int] = ()) -> TierAssignment:
        """The tier for ``client``, given the tiers of the current ``members``."""
        check_capabilities(client)
        if client.relay:  # it trains nothing; the largest tier's regions hold every other's
            return self._assignment(self.allowed[0], 0, "a relay: it carries the tiers of "
                                    "the members behind it")
        have = client.memory_bytes

        def need(tier: int) -> int:
            return self.memory.training_bytes(tier, client.microbatch_tokens)

        if client.name in self.pins:
            tier = self.pins[client.name]
            if need(tier) > have:
                raise PinnedTierDoesNotFit(
                    f"client {client.name!r} is pinned to {self._label(tier)}, which needs "
                    f"{_size(need(tier))} at {client.microbatch_tokens} tokens per microbatch; "
                    f"it reports {_size(have)}. Pin it to a smaller tier in [tiers.pins], or "
                    "lower its microbatch token budget."
                )
            return self._assignment(tier, need(tier), f"pinned by [tiers.pins]; needs "
                                    f"{_size(need(tier))} of the {_size(have)} it reports")

        floor = client.requested_tier or 0
        if floor >= FIRST_MIX_ID and floor not in self.allowed:
            raise NoAllowedTier(
                f"client {client.name!r} asked for tier {floor}, a Mix'n'Match slice this run "
                f"does not have (its tiers: {sorted(self.allowed)}); ask for one of them.")
        candidates = [t for t in self.allowed if self.ids.within(t, floor)]
        if not candidates:
            raise NoAllowedTier(
                f"client {client.name!r} asked for tier {floor} or smaller, but this run allows "
                f"only tiers {self.allowed}; ask for tier {self.allowed[-1]} or a lower index."
            )
        fits = [t for t in candidates if need(t) <= have]
        if not fits:
            smallest = candidates[-1]
            raise NoTierFits(
                f"no tier fits client {client.name!r}: the smallest it may take, "
                f"{self._label(smallest)}, needs {_size(need(smallest))} at "
                f"{client.microbatch_tokens} tokens per microbatch and it reports "
                f"{_size(have)}. Lower its microbatch token budget, free memory, or allow a "
                "smaller tier in [tiers] allowed."
            )
        if self.mix:
            tier, why = self._by_mix(fits, members)
        else:
            tier = fits[0]
            why = self._by_size(tier, candidates, need, have, client.requested_tier)
        return self._assignment(tier, need(tier), why)

    def _by_size(self, tier: int, candidates: list[int], need: Callable[[int], int], have: int,
                 requested: int | None) -> str:
        if tier != candidates[0]:
            larger = candidates[candidates.index(tier) - 1]
            return (f"{self.ids.describe(larger)} needs {_size(need(larger))}, the client "
                    f"reports {_size(have)}")
        bound = ("the tier the client asked for" if tier == requested
                 else "the largest allowed tier")
        return f"{bound}; needs {_size(need(tier))} of the {_size(have)} the client reports"

    def _by_mix(self, fits: list[int], members: Sequence[int]) -> tuple[int, str]:
        def share(tier: int) -> float:
            return sum(m == tier for m in members) / len(members) if members else 0.0

        # Rounded so that shares equal in decimal (1/3 vs 0.333...) tie; the larger model wins.
        tier = max(fits, key=lambda t: (round(self.mix.get(t, 0.0) - share(t), 9),
                                        -self.allowed.index(t)))
        held = (f"{share(tier):.0%} of the {len(members)} members have it" if members
                else "no member has joined yet")
        return tier, (f"the target mix wants {self.mix.get(tier, 0.0):.0%} at "
                      f"{self.ids.describe(tier)}; {held}")

    def _assignment(self, tier: int, estimated: int, why: str) -> TierAssignment:
        return TierAssignment(tier=tier, ffn_width=max(self.memory.widths(tier)),
                              estimated_bytes=estimated, reason=f"{self._label(tier)}: {why}")

    def _label(self, tier: int) -> str:
        widths = self.memory.widths(tier)
        if len(set(widths)) == 1:
            return f"tier {tier} (FFN {widths[0]})"
        return f"tier {tier} ({self.ids.label(tier)}, FFN {'/'.join(map(str, widths))})"


# A name and a device kind are shown on the dashboard, written to state.json and matched
# by [tiers.pins]: short printable words, nothing that could flood a page or a log line.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,63}")
_DEVICE_KIND = re.compile(r"[a-z][a-z0-9_]{0,15}")
MAX_DEVICE_NAME = 200
MAX_TOKENS_PER_SECOND = 1e9  # far beyond any one machine; more is a lie or a bug
MAX_MEMORY_BYTES = 2**50  # 1 PiB
MAX_MICROBATCH_TOKENS = 2**24
MAX_TIER = 32


def check_speed(tokens_per_second: float, who: str) -> None:
    """BadCapabilities unless ``tokens_per_second`` is a finite speed a machine can have."""
    if not (math.isfinite(tokens_per_second)
            and 0.0 <= tokens_per_second <= MAX_TOKENS_PER_SECOND):
        raise BadCapabilities(
            f"{who} reports {tokens_per_second} tokens/s; a speed is a finite number in "
            f"0..{MAX_TOKENS_PER_SECOND:g}.")


def valid_name(name: str) -> bool:
    """A member name (a client's --name, a client key's name): 1-64 letters, digits or
    . _ @ + -, starting with a letter or digit."""
    return _NAME.fullmatch(name) is not None


def check_capabilities(client: Capabilities) -> None:
    """BadCapabilities for a report the coordinator cannot take as it is."""
    if not valid_name(client.name):
        raise BadCapabilities(
            f"client name {client.name[:64]!r}{'...' if len(client.name) > 64 else ''} "
            f"({len(client.name)} characters) is not 1-64 letters, digits or . _ @ + -, "
            "starting with a letter or digit; rename the client (--name).")
    if not _DEVICE_KIND.fullmatch(client.device_kind):
        raise BadCapabilities(f"device kind {client.device_kind[:32]!r} is not a short "
                              "lowercase word such as cpu, cuda or mps.")
    if len(client.device_name) > MAX_DEVICE_NAME or not client.device_name.isprintable():
        raise BadCapabilities(f"the device name is not up to {MAX_DEVICE_NAME} printable "
                              "characters.")
    check_speed(client.tokens_per_second, f"client {client.name!r}")
    if not 0 < client.memory_bytes <= MAX_MEMORY_BYTES:
        raise BadCapabilities(f"client {client.name!r} reports {client.memory_bytes} bytes of "
                              f"memory; report the memory it can train in (1..{MAX_MEMORY_BYTES}).")
    if not 1 <= client.microbatch_tokens <= MAX_MICROBATCH_TOKENS:
        raise BadCapabilities(f"client {client.name!r} reports a microbatch of "
                              f"{client.microbatch_tokens} tokens; it must lie in "
                              f"1..{MAX_MICROBATCH_TOKENS}.")
    asked = client.requested_tier
    if asked is not None and not (0 <= asked <= MAX_TIER
                                  or FIRST_MIX_ID <= asked < FIRST_MIX_ID + MAX_MIXES):
        raise BadCapabilities(f"client {client.name!r} asked for tier {asked}; a tier is an "
                              f"integer in 0..{MAX_TIER}, or a Mix'n'Match slice's id in "
                              f"{FIRST_MIX_ID}..{FIRST_MIX_ID + MAX_MIXES - 1}.")


def _size(n: int) -> str:
    """Bytes for people: 3.1 GiB, 17.0 MiB, 512.0 KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2**10:.1f} KiB"
