"""The checks every run.toml section runs on its own values, and the bound several share.

Each section's ranges beyond "positive" sit beside it (modeling.settings bounds every number
further: floats finite, integers 64-bit); each keeps out a value that would crash or wreck
the run.
"""

from __future__ import annotations

from server.errors import InvalidValue

MAX_SECONDS = 30 * 24 * 3600.0  # deadlines, heartbeats and session lifetimes


def require(ok: bool, message: str) -> None:
    """InvalidValue with ``message`` unless ``ok``."""
    if not ok:
        raise InvalidValue(message)


def within(where: str, value: float, low: float, high: float, *, above: bool = False,
           unit: str = "") -> None:
    """InvalidValue unless ``low <= value <= high`` (``low < value`` when ``above``)."""
    ok = (low < value if above else low <= value) and value <= high
    require(ok, f"{where} must lie in {'(' if above else '['}{low}, {high}]{unit}, got {value}.")
