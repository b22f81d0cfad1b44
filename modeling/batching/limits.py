"""Microbatch limits that adapt to out-of-memory errors, remembered per length regime.

Memory use depends on sequence length, so limits are kept per *regime*: the power-of-two
bucket of a batch's longest sequence (regime k holds longest lengths in (2**(k-1), 2**k]).
An out-of-memory error on long sequences never shrinks the limits of short ones.

On out-of-memory, a regime shrinks the limit that bound the failed plan, examples first:
if its largest microbatch had ``max_examples`` rows and that is above ``min_examples``,
``max_examples`` halves; otherwise ``max_tokens`` halves from the failed plan's largest
padded microbatch, down to one sequence of the regime's longest length (2**k); with tokens at
that floor, ``max_examples`` drops below the failed microbatch's rows. Each time the next
plan's largest microbatch is strictly smaller, so retries end. When the failed microbatch
had ``min_examples`` rows or fewer at the token floor, BatchDoesNotFit is raised.

After ``stable_steps`` successes in a row, a regime's limits grow by ``growth`` toward the
configured ones: memory may have been freed, and if not, one more out-of-memory error costs
one retried batch.

This module is plain Python; ``runner.py`` connects it to torch's out-of-memory errors.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from matformer.modeling.batch import padded_size
from matformer.modeling.errors import BatchDoesNotFit, ConfigError


@dataclass(kw_only=True, slots=True)
class MicrobatchLimits:
    """How large one forward/backward pass may be."""

    max_examples: int  # rows per microbatch
    max_tokens: int  # padded tokens per microbatch: rows × longest row


@dataclass(kw_only=True, slots=True)
class AdaptiveLimitsConfig:
    """Starting microbatch limits and how they adapt; ``build()`` makes the policy."""

    max_examples: int = 64  # rows per microbatch, to start from and grow back to
    max_tokens: int = 4096  # padded tokens per microbatch, to start from and grow back to
    min_examples: int = 1  # rows shrink no further; then tokens shrink
    stable_steps: int = 100  # successes in a row before a regime's limits grow
    growth: float = 2.0  # factor the limits grow by, capped at the configured ones
    # each microbatch's rows padded up to a multiple of this (8 or 64: tensor cores' shapes);
    # its budget counts them so
    pad_to_multiple_of: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.min_examples <= self.max_examples:
            raise ConfigError(
                f"need 1 <= min_examples <= max_examples, got {self.min_examples} and "
                f"{self.max_examples}."
            )
        if self.max_tokens < 1 or self.stable_steps < 1:
            raise ConfigError(
                f"max_tokens and stable_steps must be at least 1, got {self.max_tokens} and "
                f"{self.stable_steps}."
            )
        if self.growth <= 1:
            raise ConfigError(f"growth must be above 1 so limits recover, got {self.growth}.")
        if padded_size(1, self.pad_to_multiple_of) > self.max_tokens:
            raise ConfigError(f"pad_to_multiple_of {self.pad_to_multiple_of} exceeds the "
                              f"microbatch budget of {self.max_tokens} tokens; lower it.")

    def build(self) -> AdaptiveLimits:
        return AdaptiveLimits(self)


def length_regime(longest: int) -> int:
    """Regime of a batch whose longest sequence has ``longest`` tokens: ⌈log2(longest)⌉."""
    return (longest - 1).bit_length()


@dataclass(slots=True)
class _Regime:
    limits: MicrobatchLimits  # current limits, shrunk and grown in place
    floor: MicrobatchLimits  # below these, nothing is left to shrink
    streak: int = 0  # successes since the last out-of-memory error or growth


class AdaptiveLimits:
    """Per-regime microbatch limits: ``limits`` to plan, ``shrink`` on OOM, ``succeeded``."""

    def __init__(self, config: AdaptiveLimitsConfig) -> None:
        self.config = config
        self._regimes: dict[int, _Regime] = {}

    def limits(self, longest: int) -> MicrobatchLimits:
        """The limits to plan a batch whose longest sequence has ``longest`` tokens."""
        return replace(self._regime(longest).limits)

    def shrink(self, longest: int, *, rows: int, tokens: int) -> MicrobatchLimits:
        """New limits after a plan ran out of memory; its largest microbatch had ``rows``
        rows and its largest padded size was ``tokens``. Raises BatchDoesNotFit at the floor.
        """
        regime = self._regime(longest)
        limits, floor = regime.limits, regime.floor
        regime.streak = 0
        if rows >= limits.max_examples > floor.max_examples:
            limits.max_examples = max(floor.max_examples, limits.max_examples // 2)
        elif tokens > floor.max_tokens:
            limits.max_tokens = max(floor.max_tokens, min(limits.max_tokens, tokens) // 2)
        elif rows > floor.max_examples:
            # Several short rows under the token floor: fewer rows is all that is left.
            limits.max_examples = max(floor.max_examples, rows // 2)
        else:
            raise BatchDoesNotFit(
                f"a microbatch of {rows} row(s), {tokens} padded tokens, ran out of memory at "
                f"the smallest limits for sequences up to {longest} tokens ({floor}); "
                "truncate these sequences, train a smaller tier or in bf16, or free memory."
            )
        return replace(limits)

    def succeeded(self, longest: int) -> None:
        """Record a successful batch; every ``stable_steps`` in a row, grow the limits."""
        regime = self._regime(longest)
        regime.streak += 1
        if regime.streak < self.config.stable_steps:
            return
        regime.streak = 0
        limits, config = regime.limits, self.config
        limits.max_examples = _grow(limits.max_examples, config.growth, config.max_examples)
        limits.max_tokens = _grow(limits.max_tokens, config.growth, config.max_tokens)

    def _regime(self, longest: int) -> _Regime:
        key = length_regime(longest)
        if key not in self._regimes:
            config = self.config
            self._regimes[key] = _Regime(
                MicrobatchLimits(max_examples=config.max_examples, max_tokens=config.max_tokens),
                MicrobatchLimits(
                    max_examples=config.min_examples,  # one longest sequence, padded
                    max_tokens=min(config.max_tokens,
                                   padded_size(2**key, config.pad_to_multiple_of)),
                ),
            )
        return self._regimes[key]


def _grow(value: int, factor: float, cap: int) -> int:
    return min(cap, max(value + 1, int(value * factor)))
