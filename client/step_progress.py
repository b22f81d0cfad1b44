"""``matformer-train``'s progress: a bar on a terminal (step N/M, time left, losses), and in a
log a line every ``--log-every`` steps saying as much."""

from __future__ import annotations

import time
from collections.abc import Callable

from matformer.client.progress import duration


class StepProgress:
    def __init__(self, total: int, first: int, log_every: int, say: Callable[[str], None],
                 bar: bool) -> None:
        self.total, self.first, self.log_every, self.say = total, first, log_every, say
        self.started = time.perf_counter()
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=first, unit="step", dynamic_ncols=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def update(self, done: int, losses: dict[str, float], lr: float, rate: float) -> None:
        """``done`` steps of ``total`` are done; ``losses`` per tier label at the last."""
        if self.bar is not None:
            self.bar.set_postfix({**{f"tier {t}": f"{v:.3f}" for t, v in losses.items()},
                                  "tok/s": f"{rate:,.0f}"})
            self.bar.update(1)
        elif done % self.log_every == 0 or done == self.total:
            shown = "  ".join(f"tier {t}: {loss:.3f}" for t, loss in losses.items())
            self.say(f"step {done:>5}/{self.total}  {shown}  lr {lr:.2e}  {rate:,.0f} tok/s"
                     f"  {self._left(done)}")

    def _left(self, done: int) -> str:
        """The time the remaining steps take at this process's pace so far."""
        if done >= self.total:
            return "done"
        pace = (time.perf_counter() - self.started) / (done - self.first)  # s per step
        return f"left {duration(pace * (self.total - done))}"
