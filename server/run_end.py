"""When ``matformer-server`` ends on its own: once the run is finished (its [round] rounds or
tokens reached, also when a finished run is started again) it logs the run's summary and,
unless ``[server] stay_after_finish``, exits once its members are gone.

Members learn that the run is over from their next GetRound, then fetch the last update and
leave; the server waits for that rather than for a fixed time, so no member is cut off while
it catches up. A member counts as gone once it has left or has been silent for [faults]
heartbeat_timeout_s (the run's own rule for a vanished member; a live one heartbeats every
heartbeat_s, also while it trains). However members behave, the server exits at most
[round] deadline_s plus heartbeat_timeout_s after the finish: a member still busy then would
have missed a round's deadline too.

    end = RunEnd.of(coordinator, stay=config.server.stay_after_finish)
    while not stop.wait(END_POLL_S) and not end.reached():
        pass
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from matformer.server.run_log import summary_line

END_POLL_S = 0.5  # how often the server looks whether its run ended
log = logging.getLogger("matformer.server")


class RunEnd:
    def __init__(self, *, phase: Callable[[], str], snapshot: Callable[..., dict[str, Any]],
                 checkpoint_path: Callable[[int], Path], deadline_s: float, silence_s: float,
                 stay: bool) -> None:
        """``phase()`` and ``snapshot(...)``: the coordinator's; ``silence_s``: [faults]
        heartbeat_timeout_s, after which a silent member counts as gone."""
        self.phase, self.snapshot, self.checkpoint_path = phase, snapshot, checkpoint_path
        self.deadline_s, self.silence_s = deadline_s, silence_s
        self.stay = stay  # [server] stay_after_finish: serve on until a signal
        self.finished_at: float | None = None  # monotonic time the finish was seen

    @classmethod
    def of(cls, coordinator: Any, *, stay: bool) -> RunEnd:
        """The end of a ``Coordinator``'s run, by its config (typed loosely: this part does
        not import the coordinator)."""
        config = coordinator.config
        return cls(phase=lambda: coordinator.phase, snapshot=coordinator.snapshot,
                   checkpoint_path=coordinator.checkpoints.path,
                   deadline_s=config.round.deadline_s,
                   silence_s=config.faults.heartbeat_timeout_s, stay=stay)

    def reached(self) -> bool:
        """Whether the server should exit now: the run is finished and its members are gone
        (or deadline_s + heartbeat_timeout_s passed since). Says the summary once, when the
        finish is first seen."""
        if self.phase() != "finished":
            return False
        now = time.monotonic()
        if self.finished_at is None:
            self.finished_at = now
            status = self.snapshot(since_round=0, events_after=None)
            log.info("%s", summary_line(status, self.checkpoint_path(status["checkpoints"][-1])))
            if self.stay:
                log.info("serving on after the finish (stay_after_finish in [server]): the "
                         "dashboard and the checkpoint files, until Ctrl-C or SIGTERM")
        if self.stay:
            return False
        status = self.snapshot(since_round=None, events_after=None)
        live = [m["name"] for m in status["members"]
                if status["now"] - m["last_seen"] <= self.silence_s]
        if not live:
            log.info("every member has left (or is silent for heartbeat_timeout_s); exiting")
            return True
        if now - self.finished_at > self.deadline_s + self.silence_s:
            log.warning("exiting although %s did not leave within %.0f s of the finish",
                        ", ".join(live), now - self.finished_at)
            return True
        return False
