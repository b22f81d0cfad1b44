"""One line per trained round: a tqdm bar on a terminal, plain lines in a log."""

from __future__ import annotations

from collections.abc import Callable


class Progress:
    def __init__(self, log: Callable[[str], None], bar: bool) -> None:
        self.log = log
        self.bar = None
        if bar:
            from tqdm import tqdm

            self.bar = tqdm(unit="round", dynamic_ncols=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.close()

    def update(self, round_index: int, tier: int, loss: float, speed: float, sent: int,
               accepted: int) -> None:
        if self.bar is not None:
            self.bar.set_description(f"round {round_index}")
            self.bar.set_postfix(tier=tier, loss=f"{loss:.3f}", tok_s=f"{speed:,.0f}",
                                 sent=f"{sent / 1024:.0f}KiB")
            self.bar.update(1)
        else:
            self.log(f"round {round_index:>4}  tier {tier}  loss {loss:.3f}  {speed:,.0f} tok/s"
                     f"  sent {sent / 1024:,.1f} KiB ({accepted} results)")
