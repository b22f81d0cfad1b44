"""One line per trained round: a tqdm bar on a terminal, plain lines in a log, each measured
against how far the run goes (``Planned``, from the coordinator at join):

- the run stops after M rounds: ``round N/M`` and the time left, N counting the rounds done
  once this one closes (the dashboard's "round N of M");
- it stops after T tokens: the run's tokens of T (as of the round's handing out) and the
  time left;
- the coordinator did not say (an older one): ``round N`` alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tqdm import tqdm

    from matformer.client.connection import Finished, Train


@dataclass(frozen=True, slots=True)
class Planned:
    """How far the run goes: ``rounds`` when that stop comes first, else ``tokens``; None
    where the coordinator does not say."""

    rounds: int | None = None
    tokens: int | None = None

    @property
    def by_tokens(self) -> bool:
        return self.rounds is None and self.tokens is not None

    @property
    def total(self) -> int | None:
        """Rounds, or (by tokens) tokens, when the run ends; None: not said."""
        return self.tokens if self.by_tokens else self.rounds


class Progress:
    def __init__(self, log: Callable[[str], None], bar: bool,
                 planned: Planned = Planned()) -> None:
        self.log = log
        self.planned = planned
        self.wants_bar = bar
        self.bar: tqdm | None = None  # made at the first round shown, where the run is then
        self._start: tuple[float, int] | None = None  # (clock, done) at the first round shown

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()

    def update(self, work: Train, tier: int, loss: float, speed: float, sent: int,
               accepted: int) -> None:
        """``work`` was trained and its results taken."""
        done = work.run_tokens if self.planned.by_tokens else work.round + 1
        if self._start is None:
            self._start = (time.monotonic(), done)
        if self.wants_bar:
            self._make_bar(done).set_postfix(tier=tier, loss=f"{loss:.3f}", tok_s=f"{speed:,.0f}",
                                             sent=f"{sent / 1024:.0f}KiB", refresh=False)
            self._advance(done)
            return
        planned = self.planned
        where = (f"round {work.round + 1:>4}  run tokens {done:,}/{planned.total:,}"
                 if planned.by_tokens else f"round {done:>4}"
                 + (f"/{planned.total}" if planned.total else ""))
        self.log(f"{where}  tier {tier}  loss {loss:.3f}  {speed:,.0f} tok/s"
                 f"  sent {sent / 1024:,.1f} KiB ({accepted} results){self._left(done)}")

    def finished(self, end: Finished) -> None:
        """The run is over: the bar shows where it ended."""
        if self.bar is not None:
            self._advance(end.run_tokens if self.planned.by_tokens else end.round)

    def _make_bar(self, done: int) -> tqdm:
        if self.bar is None:
            from tqdm import tqdm  # only for a terminal

            tokens = self.planned.by_tokens
            self.bar = tqdm(total=self.planned.total, initial=done, dynamic_ncols=True,
                            desc="tokens" if tokens else "round",
                            unit="tok" if tokens else "round", unit_scale=tokens)
        return self.bar

    def _advance(self, done: int) -> None:
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)
        else:
            self.bar.refresh()

    def _left(self, done: int) -> str:
        """``  left 3m20s`` at this client's pace since its first round shown; "" without a
        total or a pace yet."""
        start, first = self._start
        if not self.planned.total or done <= first:
            return ""
        pace = (time.monotonic() - start) / (done - first)  # seconds per round or token
        return f"  left {duration(pace * max(self.planned.total - done, 0))}"


def duration(seconds: float) -> str:
    """``1h02m``, or ``3m20s`` under an hour."""
    minutes, seconds = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"
