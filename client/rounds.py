"""A participant's round loops (docs/architecture.md, "One round"): synchronous rounds,
and overlapped ones (``[round] overlap``), where the client never waits for a close, an
upload or a download between rounds.

Round r starts from the weights after r - 1 rounds (round 0 from the start): round r - 1's
update is applied as soon as it arrives. Under local steps that is between two inner steps
of round r, which starts from an estimate of it (eager updates: ``LocalRound._local_steps``);
otherwise, and on a data-parallel node, after round r is trained. Every call the
loop needs but the first runs beside the training, on three threads: uploads, sequences
and updates (an update is asked for ahead and held by the coordinator until its round
closes, so the sequences must not queue behind it):

- the results of round r are uploaded while round r + 1 trains, and the answer carries the
  client's next assignments (the coordinator hands rounds out ahead);
- the sequences of each assignment are fetched as soon as it is known;
- the updates are asked for ahead, the coordinator holding the call until the round closes.

So in steady state a round costs a SubmitResult, a FetchSequences and a GetUpdates, none of
which the training waits for. Replicas stay bit-identical: every update is applied whole, in
order, and its hash compared with the coordinator's, as without overlap.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import Tensor

from matformer.client.connection import Finished, Submitted, Train, Wait
from matformer.client.errors import RoundOver, UpdatesPruned
from matformer.client.local_round import Advance
from matformer.client.progress import Progress
from matformer.modeling.compression import RoundUpdate
from matformer.modeling.matformer import tier_label

if TYPE_CHECKING:
    from matformer.client.federated import FederatedClient

T = TypeVar("T")


class Reassigned(Exception):  # a signal within the loop, not an error
    """The round a client waits for needs its work first: ``work``, handed out anew."""

    def __init__(self, work: Train) -> None:
        super().__init__(f"round {work.round} handed out anew")
        self.work = work
UPDATE_WAIT_S = 20.0  # how long one GetUpdates may wait for a round to close


def finished(c: FederatedClient, work: Finished, progress: Progress) -> None:
    """The run is over: the summary says so, and the log what the replica holds."""
    c.summary.finished = True
    progress.finished(work)
    c.catch_up()
    c.log(f"the run finished after round {work.round - 1}; the replica holds the weights "
          f"after {c.applied} rounds, weight hash {c.replica.hash(c.named)[:12]}")


class SynchronousRounds:
    """Ask for a round, train it on the weights after every round before it, submit, catch
    up; between rounds the client waits for the others, the close and the download."""

    def __init__(self, client: FederatedClient) -> None:
        self.client = client

    def run(self) -> None:
        c = self.client
        o = c.options
        bar = o.progress if o.progress is not None else sys.stderr.isatty()
        # heartbeats from the first round to the last, through catching up and waiting too
        with Progress(c.log, bar, c.member.planned) as progress, c.connection.keep_alive(
                lambda: c.applied):
            while o.max_rounds is None or c.summary.rounds_trained < o.max_rounds:
                work = c.connection.get_round()
                if work.round > c.applied:
                    c.catch_up()
                match work:
                    case Finished():
                        finished(c, work, progress)
                        return
                    case Wait():
                        pause = max(work.retry_after_s, 0.05)
                        time.sleep(pause)
                        c.cost.wait_s += pause
                    case Train() if work.round != c.applied:
                        continue  # the log lags the round that opened; ask again
                    case Train():
                        if work.tier != c.tier:
                            c.log(f"the coordinator moved this client from tier "
                                  f"{c.tier} to tier {work.tier}; reloading")
                            c.summary.tier = work.tier
                            c.catch_up(reload=True)
                        c.train_round(work, progress)


class OverlappedRounds:
    """Train each round as soon as the one before is trained, on the weights after r - 1
    rounds; uploads, sequences and updates move on their threads meanwhile."""

    def __init__(self, client: FederatedClient) -> None:
        self.client = client
        self.held: deque[Train] = deque()  # assignments in hand, oldest first
        self.taken: set[str] = set()  # assignment ids trained or being trained
        # uploads, sequences and updates each on a thread of their own: a GetUpdates held
        # until a round closes delays neither an upload nor the next round's sequences
        self.uploads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="uploads")
        self.fetches = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sequences")
        self.downloads = ThreadPoolExecutor(max_workers=1, thread_name_prefix="updates")
        self.sequences: dict[str, Future] = {}  # assignment id → its sequences, fetched ahead
        self.upload: tuple[Train, object, float, Future] | None = None  # the one in flight
        self.fetched: dict[int, RoundUpdate] = {}  # updates received, not applied yet
        self.asked: Future | None = None  # updates being asked for

    def run(self) -> None:
        c, o = self.client, self.client.options
        bar = o.progress if o.progress is not None else sys.stderr.isatty()
        interrupted = False
        try:
            with Progress(c.log, bar, c.member.planned) as progress, c.connection.keep_alive(
                    lambda: c.applied):
                while o.max_rounds is None or c.summary.rounds_trained < o.max_rounds:
                    work = self._next(progress)
                    if work is None:
                        return
                    self._train(work, progress)
                self._settle_upload(progress)
        except KeyboardInterrupt:
            # Ctrl-C waits for no call in flight (a GetUpdates held for UPDATE_WAIT_S, an
            # upload retrying): the client leaves and closes the connection, which ends them
            interrupted = True
            raise
        finally:
            for pool in (self.uploads, self.fetches, self.downloads):
                pool.shutdown(wait=not interrupted, cancel_futures=True)

    # -- the next assignment ------------------------------------------------------------

    def _next(self, progress: Progress) -> Train | None:
        """The next assignment to train; None once the run is finished."""
        c = self.client
        while not self.held:
            self._settle_upload(progress)
            if self.held:
                break
            # nothing held and no upload in flight: the oldest assignment not yet submitted,
            # which is new work (one it trained was taken, or refused and split anew)
            work = c.connection.get_round()
            match work:
                case Finished():
                    finished(c, work, progress)
                    return None
                case Wait():
                    pause = max(work.retry_after_s, 0.05)
                    time.sleep(pause)
                    c.cost.wait_s += pause
                case Train():
                    self._hold([work])
        work = self.held.popleft()
        self.taken.add(work.assignment_id)
        return work

    def _hold(self, assignments: list[Train]) -> None:
        """Keep the assignments not yet held or taken (an answer lists the one being
        trained too), and fetch their sequences ahead."""
        known = self.taken | {w.assignment_id for w in self.held}
        for work in assignments:
            if work.assignment_id not in known:
                self.held.append(work)
                self.sequences[work.assignment_id] = self.fetches.submit(
                    self.client.sequences.fetch, work.sequence_ids)

    # -- one round ----------------------------------------------------------------------

    def _train(self, work: Train, progress: Progress) -> None:
        c = self.client
        if work.tier != c.tier:
            self._settle_upload(progress)
            c.log(f"the coordinator moved this client from tier {c.tier} to tier "
                  f"{work.tier}; reloading")
            c.summary.tier = work.tier
            c.catch_up(reload=True)
            self.fetched.clear()
        try:
            self._apply_through(work.round - 2)
        except Reassigned as new:
            c.log(f"round {new.work.round} was handed out anew (the coordinator restarted?): "
                  f"training it before round {work.round}, whose assignment is dropped")
            self._drop_held()
            self._hold([new.work])
            return
        if self.asked is None and work.round >= 1:  # what the next round trains on: the
            self._ask(work.round - 1)  # update of this one's predecessor, closing meanwhile
        if c.local_round is None:
            c.build_local_round()
        try:
            fetched = self.sequences.pop(work.assignment_id, None)
            if fetched is None:  # a refused upload dropped the fetches ahead (_drop_held)
                fetched = self.fetches.submit(c.sequences.fetch, work.sequence_ids)
            sequences = [s.to(c.device) for s in self._waited(fetched)]
        except RoundOver as err:
            c.log(f"round {work.round} is over for this client: {err.details}")
            return
        advance = self._advance(work) if c.node.world_size == 1 else None
        done = c.compute(sequences, work.round, advance)
        self._settle_upload(progress)  # one upload at a time, in round order
        loss = done.losses[tier_label(c.named)]
        self.upload = (work, done, loss, self.uploads.submit(
            c.connection.submit, work, client_id=c.summary.client_id, tokens=done.tokens,
            loss=loss, train_seconds=done.seconds, results=done.results))

    def _settle_upload(self, progress: Progress) -> None:
        """Wait for the upload in flight, if any, and take what its answer says."""
        if self.upload is None:
            return
        c = self.client
        work, done, loss, future = self.upload
        self.upload = None
        try:
            submitted: Submitted = self._waited(future)
        except RoundOver as err:
            # Too late or refused: the error feedback keeps what it was not sent, and goes
            # into a later round's results (the next round has trained on it already). What
            # it holds may be stale too (a restarted coordinator splits its rounds anew):
            # drop it and ask for the assignments as they are now.
            c.log(f"round {work.round} not accepted: {err.details}")
            self.taken.discard(work.assignment_id)  # if it is still this client's, again
            self._drop_held()
            return
        c.accepted(work, done, loss, submitted.sent, submitted.accepted, progress)
        self._hold(submitted.assignments)

    def _drop_held(self) -> None:
        """Forget the assignments held (another split's), and their sequences' fetches."""
        self.held.clear()
        for fetching in self.sequences.values():
            fetching.cancel()
        self.sequences.clear()

    def _waited(self, future: Future[T]) -> T:
        """``future``'s result; the time the loop waits for it counts as waiting."""
        start = time.monotonic()
        try:
            return future.result()
        finally:
            self.client.cost.wait_s += time.monotonic() - start

    # -- the weights a round trains on ----------------------------------------------------

    def _advance(self, work: Train) -> Advance:
        """Under local steps, the update of round r - 1 applied while round r trains, as
        soon as it arrives (``LocalRound._local_steps`` moves the training with it)."""
        c = self.client

        def advance(exact: dict[str, Tensor]) -> dict[str, Tensor] | None:
            due = work.round - 1
            if c.applied != due or self.asked is None or not self.asked.done():
                return None
            asked, self.asked = self.asked, None
            try:
                arrived = asked.result()
            except Exception:  # the loop meets the error again when it asks between rounds
                return None
            for update in arrived:
                self.fetched.setdefault(update.round, update)
            if due not in self.fetched:  # the wait ran out before the round closed
                self._ask(due)
                return None
            update = self.fetched.pop(due)
            parameters = c.replica.parameters
            with torch.no_grad():
                trained = {name: p.detach().clone() for name, p in parameters.items()}
                for name, p in parameters.items():
                    p.copy_(exact[name])
                diverged = c.replay([update])
                moved = {name: p.detach().clone() for name, p in parameters.items()}
                for name, p in parameters.items():
                    p.copy_(trained[name])
            if diverged is not None:  # the loop finds it again between rounds, and reloads
                c.applied, self.fetched[due] = due, update
                return None
            c.summary.rounds_applied = c.applied
            c.summary.advanced += 1
            return moved

        return advance

    def _check_waited_for(self, round_index: int) -> None:
        """Reassigned when the coordinator hands this client work in round
        ``round_index`` or before: that round cannot close without it. The assignments
        held from before are another split's (a restart reopens the rounds in flight and
        hands their work out anew), so waiting for its update would wait for ever."""
        work = self.client.connection.get_round()
        if isinstance(work, Train) and work.round <= round_index \
                and work.assignment_id not in self.taken:
            raise Reassigned(work)

    def _ask(self, since: int) -> None:
        """Ask for the updates from round ``since`` on, held until that round closes."""
        c = self.client
        self.asked = self.downloads.submit(c.broadcast.updates, since, c.tier,
                                           wait_s=UPDATE_WAIT_S)

    def _apply_through(self, last: int) -> None:
        """Apply every update through round ``last`` (none beyond it): what was received
        ahead, else asked for now, waiting for its close. Reassigned when the round waited
        for needs this client's work first (a restarted coordinator split it anew)."""
        c = self.client
        while c.applied <= last:
            if self.asked is not None and (self.asked.done() or c.applied not in self.fetched):
                asked, self.asked = self.asked, None
                try:
                    for update in self._waited(asked):
                        self.fetched.setdefault(update.round, update)
                except UpdatesPruned:
                    c.log(f"updates since round {c.applied} are pruned; reloading the "
                          "checkpoint")
                    c.catch_up(reload=True)
                    self.fetched.clear()
                    continue
                if c.applied not in self.fetched:  # a whole wait, and the round is open
                    self._check_waited_for(c.applied)
            if c.applied not in self.fetched:
                self._ask(c.applied)
                continue
            ready = []
            while c.applied + len(ready) <= last and c.applied + len(ready) in self.fetched:
                ready.append(self.fetched.pop(c.applied + len(ready)))
            diverged = c.replay(ready)
            if diverged is not None:
                c.log(f"weight hash after round {diverged} differs from the coordinator's; "
                      "reloading the checkpoint")
                c.summary.resynchronisations += 1
                c.catch_up(reload=True)
                self.fetched.clear()
        for stale in [r for r in self.fetched if r < c.applied]:
            del self.fetched[stale]
        c.summary.rounds_applied = c.applied
        c.summary.update_bytes = c.broadcast.update_bytes
