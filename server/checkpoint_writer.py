"""Checkpoints beside the rounds, and which are kept (docs/architecture.md, "The coordinator").

    writer = CheckpointWriter(lock, checkpoints, policy, history, update_log, state=...,
                              save=..., mark_unsaved=...)
    writer.start(round_index, master, carried)   # (lock held) by a thread of its own
    writer.wait()                       # (no lock) until it is done; re-raises a crash
    writer.retire()                     # (lock held) keep_last, then prune the update log

A checkpoint is written while the next rounds go on, listed in state.json once whole, and
only then are older ones retired and the update log pruned to the rounds since the one
before it. One that cannot be written is said and left out: the log keeps the rounds since
the last listed checkpoint, and the next one tries again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from torch import Tensor

from matformer.server.errors import RunDirectoryUnavailable
from matformer.server.shards import pin
from matformer.server.update_steps import Carried

if TYPE_CHECKING:
    from matformer.server.checkpoints import CheckpointStore
    from matformer.server.history import RunHistory
    from matformer.server.sections import CheckpointSection
    from matformer.server.state import RunState
    from matformer.server.update_log import UpdateLog

log = logging.getLogger("matformer.server")


class CheckpointWriter:
    def __init__(self, lock: threading.RLock, checkpoints: CheckpointStore,
                 policy: CheckpointSection, history: RunHistory, update_log: UpdateLog, *,
                 state: Callable[[], RunState], save: Callable[[], None],
                 mark_unsaved: Callable[[], None]) -> None:
        """``lock``: the coordinator's, which ``state`` (the run's, as it is now) and the
        rest are changed under; ``save`` writes state.json (RunDirectoryUnavailable when it
        cannot), ``mark_unsaved`` says it changed in memory."""
        self.lock, self.checkpoints, self.policy = lock, checkpoints, policy
        self.history, self.log, self.state = history, update_log, state
        self.save, self.mark_unsaved = save, mark_unsaved
        self.writing: int | None = None  # the round of the checkpoint being written
        self._thread: threading.Thread | None = None
        self._failed: BaseException | None = None

    def start(self, round_index: int, master: Mapping[str, Tensor], carried: Carried) -> None:
        """(lock held) Write the checkpoint of ``round_index`` (weights and the outer state
        carried after its round) from a thread of its own. Neither is changed in place
        afterwards: later closes make new tensors."""
        self.writing = round_index
        release = pin(master)  # a sharded master's shards keep it until it is written
        self._thread = threading.Thread(target=self._write,
                                        args=(round_index, master, carried, release),
                                        name=f"checkpoint-{round_index}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """(no lock) Until the checkpoint being written, if any, is done; re-raise what
        killed its writer."""
        thread = self._thread
        if thread is not None:
            thread.join()
        failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    def _write(self, round_index: int, master: Mapping[str, Tensor], carried: Carried,
               release: Callable[[], None]) -> None:
        try:
            self.checkpoints.write(round_index, master, carried)
        except OSError as err:
            release()
            with self.lock:
                why = f"{type(err).__name__}: {err.strerror or err}"
                log.error("checkpoint round-%d could not be written: %s", round_index, why)
                self.history.event("disk", None, f"checkpoint round-{round_index} could not "
                                   f"be written ({why}); the next checkpoint tries again")
                self.writing = None
                self.keep_listed(why="a checkpoint that could not be written")
            return
        except BaseException as err:  # a crash (kill -9 in tests): flush re-raises it
            release()
            self._failed = err
            return
        release()
        with self.lock:
            self.writing = None
            state = self.state()
            state.checkpoints.append(round_index)
            try:
                self.save()
            except RunDirectoryUnavailable as err:
                state.checkpoints.remove(round_index)
                log.warning("checkpoint round-%d is written but not listed: %s", round_index,
                            err)
                return
            self.history.event("checkpoint", None, f"checkpoints/round-{round_index}")
            self.mark_unsaved()  # the event reaches state.json with the next save or flush
            self.retire()

    def retire(self) -> None:
        """(lock held) Keep the newest [checkpoint] keep_last checkpoints (at least the
        latest, which a resume needs, and the one before it, where the update log starts and
        which a client that began loading it may still be reading), and the first with
        keep_first. state.json stops listing the others first, then their folders go: a crash
        in between leaves folders no state lists, which the next start removes. A failed save
        keeps them all until the next close. Then the update log is pruned."""
        policy, state = self.policy, self.state()
        listed = state.checkpoints
        first = 1 if policy.keep_first else 0  # the run's starting weights, for comparisons
        retired = listed[first:-policy.keep_last]
        if retired:
            state.checkpoints = listed[:first] + listed[-policy.keep_last:]
            try:
                self.save()
            except RunDirectoryUnavailable as err:
                state.checkpoints = listed
                log.warning("keeping checkpoints %s for now: %s", retired, err)
                return
            self.keep_listed(why="retired (keep_last)")
        try:
            self.log.prune(through=state.log_start() - 1)
        except OSError as err:  # a later close prunes again
            log.warning("pruning %s failed: %s", self.log.directory, err)

    def keep_listed(self, *, why: str, level: int = logging.INFO) -> None:
        """(lock held) Remove the checkpoint folders state.json does not list, but the one
        being written."""
        keep = {*self.state().checkpoints, *([self.writing] if self.writing is not None
                                             else [])}
        self.checkpoints.keep_only(keep, why=why, level=level)

    def remove_unlisted(self) -> None:
        """Staging folders and checkpoint folders that state.json does not list: what a crash
        in the middle of writing one (or before state.json recorded it, or after it stopped
        listing a retired one) left behind."""
        self.keep_listed(level=logging.WARNING,
                         why="an unfinished or retired checkpoint from before a restart")
