"""What the run.toml sections share beyond their declarations: the checks that involve two
keys or a computed bound, and the unit of their durations."""

from __future__ import annotations

from matformer.server.errors import InvalidValue

MAX_SECONDS = 30 * 24 * 3600.0  # deadlines, heartbeats and session lifetimes
MIN_IDLE_S = 0.5  # a stream's or request's idle bound: shorter ends honest calls on a busy host
MAX_COUNT = 1_000_000  # rounds, members, misses and such counts of one run
MAX_TOKENS = 2**50  # tokens of one run (2**40 of one round): far past any, far from overflow
SECONDS = " seconds"  # their unit, in a range's error


def require(ok: bool, message: str) -> None:
    """InvalidValue with ``message`` unless ``ok``."""
    if not ok:
        raise InvalidValue(message)


def within(where: str, value: float, low: float, high: float, *, unit: str = "") -> None:
    """InvalidValue unless ``low <= value <= high``: a range computed from other values."""
    require(low <= value <= high, f"{where} must lie in [{low}, {high}]{unit}, got {value}.")
