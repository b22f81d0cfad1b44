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

    end = RunEnd(coordinator, stay=config.server.stay_after_finish)
    while not stop.wait(END_POLL_S) and not end.reached():
        pass
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from matformer.server.run_log import summary_line

if TYPE_CHECKING:
    from matformer.server.coordinator import Coordinator

END_POLL_S = 0.5  # how often the server looks whether its run ended
log = logging.getLogger("matformer.server")


class RunEnd:
    def __init__(self, coordinator: Coordinator, *, stay: bool) -> None:
        self.coordinator = coordinator
        self.stay = stay  # [server] stay_after_finish: serve on until a signal
        self.finished_at: float | None = None  # monotonic time the finish was seen

    def reached(self) -> bool:
        """Whether the server should exit now: the run is finished and its members are gone
        (or deadline_s + heartbeat_timeout_s passed since). Says the summary once, when the
        finish is first seen."""
        c = self.coordinator
        if c.phase != "finished":
            return False
        now = time.monotonic()
        if self.finished_at is None:
            self.finished_at = now
            status = c.snapshot(since_round=0, events_after=None)
            log.info("%s", summary_line(status, c.checkpoints.path(status["checkpoints"][-1])))
            if self.stay:
                log.info("serving on after the finish (stay_after_finish in [server]): the "
                         "dashboard and the checkpoint files, until Ctrl-C or SIGTERM")
        if self.stay:
            return False
        status = c.snapshot(since_round=None, events_after=None)
        faults = c.config.faults
        live = [m["name"] for m in status["members"]
                if status["now"] - m["last_seen"] <= faults.heartbeat_timeout_s]
        if not live:
            log.info("every member has left (or is silent for heartbeat_timeout_s); exiting")
            return True
        if now - self.finished_at > c.config.round.deadline_s + faults.heartbeat_timeout_s:
            log.warning("exiting although %s did not leave within %.0f s of the finish",
                        ", ".join(live), now - self.finished_at)
            return True
        return False
