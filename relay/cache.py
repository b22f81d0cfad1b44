"""What the relay serves its members from the root: each round's update per tier and each
checkpoint file, fetched once and kept; from an HTTP mirror of the root's broadcast first
when the relay has one (``--mirror``, ``client.mirror.MirrorFirst``), from the root else.
The root stays the authority: a round comes from the mirror only as the root's headers say
it closed (``client.mirror.same_rounds``), as a member checks its own mirror.

    source = MirrorFirst(mirror_url_or_None, log)
    updates = UpdateCache(root, source)
    updates.messages(since_round, tier, wait_s)   # the rounds from since_round on, as sent
    files = FileCache(root, folder, source)
    files.path("round-4/matformer_manifest.json")  # downloaded once, then from disk

Members asking at once make one upstream call at a time: the first asks, the others wait for
its answer and take what it brought from the cache. Updates and checkpoint files never change once
published, so nothing here is ever refreshed; the oldest rounds leave past ``KEEP_ROUNDS``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

from matformer.client.mirror import HttpMirror, MirrorFirst, same_rounds
from matformer.modeling.checkpoint.files import read_json
from matformer.modeling.checkpoint.manifest import MANIFEST_NAME, Manifest
from matformer.protocol.files import resolve_inside
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.relay.upstream import Upstream, rounds_of

KEEP_ROUNDS = 16  # per tier: a member that fell further behind loads a checkpoint


class UpdateCache:
    def __init__(self, root: Upstream, source: MirrorFirst,
                 closed: Callable[[], int] = lambda: 0) -> None:
        """``closed()``: how many rounds the root has closed, as its last answer said; a
        request that the cache holds only the start of asks the root for the rest."""
        self.root = root
        self.source = source
        self.closed = closed
        self._rounds: dict[tuple[int, int], list[pb.UpdateMessage]] = {}  # (round, tier)
        self._lock = threading.Lock()
        # one upstream call at a time, whatever the tier: a call waiting for a close holds
        # one of the few streams the root lets a member hold, and after the close the
        # other tiers' calls answer at once
        self._asking = threading.Lock()
        self.fetched = 0  # rounds taken from the root
        self.served = 0  # rounds sent to members

    def messages(self, since_round: int, tier: int, wait_s: float) -> list[pb.UpdateMessage]:
        """The rounds from ``since_round`` on that the root has closed, at ``tier``; waits up
        to ``wait_s`` for ``since_round`` to close when none has. Raises the root's
        ``grpc.RpcError`` (a pruned round, a stopped root) for the caller to pass on."""
        held, after = self._held(since_round, tier)
        if held and after >= self.closed():
            return self._serve(held, after - since_round)
        until = time.monotonic() + wait_s  # the member's wait, the queue for the call counted
        with self._asking:  # another member may have asked meanwhile
            held, after = self._held(since_round, tier)
            if held and after >= self.closed():
                return self._serve(held, after - since_round)
            # from the first round not held; no wait when some are (they answer at once)
            wait = (lambda: 0.0) if held else (lambda: max(0.0, until - time.monotonic()))
            fresh = self.source.take(
                f"updates from round {after}", lambda mirror: self._mirrored(
                    mirror, after, tier, wait()),
                lambda: list(rounds_of(self.root.updates(after, tier, wait()))))
            with self._lock:
                for round_index, messages in fresh:
                    self._rounds[round_index, tier] = messages
                    self.fetched += 1
                for key in sorted(self._rounds)[:-KEEP_ROUNDS * 4]:  # every tier's oldest
                    del self._rounds[key]
        held, after = self._held(since_round, tier)
        return self._serve(held, after - since_round)

    def _mirrored(self, mirror: HttpMirror, since_round: int, tier: int, wait_s: float
                  ) -> list[tuple[int, list[pb.UpdateMessage]]]:
        """The rounds the root has closed from ``since_round`` on, from the mirror: the root
        says which and their headers (waiting up to ``wait_s``), and the mirror must list
        each with that header, else ``MirrorFailed`` (the root is the authority: a mirror
        that withholds or forges a round does not reach the relay's members)."""
        published = self.root.published(since_round, tier, wait_s)
        if not published:
            return []
        got = mirror.rounds(since_round, tier)[:len(published)]
        same_rounds([update for update, _ in got], published, tier)
        return [(update.round, messages) for update, messages in got]

    def _serve(self, messages: list[pb.UpdateMessage], rounds: int) -> list[pb.UpdateMessage]:
        with self._lock:
            self.served += rounds
        return messages

    def _held(self, since_round: int, tier: int) -> tuple[list[pb.UpdateMessage], int]:
        """The cached rounds from ``since_round`` on, one after another, and the first round
        after them (the first not cached)."""
        sent: list[pb.UpdateMessage] = []
        with self._lock:
            round_index = since_round
            while (round_index, tier) in self._rounds:
                sent += self._rounds[round_index, tier]
                round_index += 1
        return sent, round_index


class FileCache:
    def __init__(self, root: Upstream, folder: Path, source: MirrorFirst) -> None:
        self.root = root
        self.folder = folder
        self.source = source
        self._locks: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        self.fetched = 0  # files taken from the root

    def path(self, relative: str) -> Path:
        """The root's file ``relative`` (of its checkpoint directory), on this disk.
        Raises ``UnsafePath`` for a path outside it, the root's ``grpc.RpcError`` else."""
        local = resolve_inside(self.folder, relative)
        with self._lock:
            lock = self._locks.setdefault(relative, threading.Lock())
        with lock:
            if not local.is_file():
                try:
                    self._fetch(relative, local)
                except BaseException:  # a path not fetched keeps nothing here, not even a lock
                    with self._lock:
                        self._locks.pop(relative, None)
                    raise
                self.fetched += 1
        return local

    def _fetch(self, relative: str, local: Path) -> None:
        """The root's file ``relative`` to ``local``, from the mirror first where the manifest
        vouches for it; the folders made for it are removed again when it fails."""
        made = [p for p in local.parents if not p.exists()]  # innermost first
        local.parent.mkdir(parents=True, exist_ok=True)
        try:
            sha256 = self._listed(relative)
            if sha256 is None:  # a manifest, or a file no manifest vouches for
                self.root.download(relative, local)
            else:
                self.source.take(relative, lambda m: m.download(sha256, local) or sha256,
                                 lambda: self.root.download(relative, local))
        except BaseException:
            for folder in made:
                with contextlib.suppress(OSError):  # another fetch put a file in it meanwhile
                    folder.rmdir()
            raise

    def _listed(self, relative: str) -> str | None:
        """The sha256 the manifest of ``relative``'s checkpoint gives it (the manifest comes
        from the root, as a member's does), None for a manifest or a path none lists."""
        folder, _, name = relative.partition("/")
        if self.source.mirror is None or not name or name == MANIFEST_NAME:
            return None
        manifest = Manifest.from_dict(read_json(self.path(f"{folder}/{MANIFEST_NAME}")))
        return manifest.sha256.get(name)
