"""What a member catches up from: the run's logged round updates, each encoded once per tier
and fed by every close, and its checkpoints' files. The coordinator commits rounds and
checkpoints; this part only reads them, for the member RPCs (GetUpdates, GetCheckpoint,
DownloadCheckpoint) and the HTTP broadcast (server/blobs.py, over ``updates``).

    catch_up = CatchUp(update_log, checkpoints, regions, tiers, logged=..., latest=...,
                       wait=...)
    coordinator.round_closed.append(catch_up.closed)
    catch_up.rounds(since_round=4, tier=1, wait_s=5.0)  # each round's update messages
    catch_up.checkpoint(tier=1)                          # a ServedCheckpoint
    catch_up.chunks("round-4/matformer_manifest.json")   # a served file's chunks
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from google.protobuf.message import Message

from matformer.modeling.checkpoint.export import read_manifest
from matformer.modeling.checkpoint.manifest import MANIFEST_NAME
from matformer.modeling.compression import Region
from matformer.modeling.errors import CheckpointError
from matformer.modeling.matformer import NO_MIXES, TierIds, tier_label
from matformer.protocol.records import ServedCheckpoint, ServedEntry
from matformer.server.checkpoints import CheckpointRef, CheckpointStore
from matformer.server.close import ClosedRound
from matformer.server.errors import NotARunTier, UpdatesPruned
from matformer.server.served_files import served_files
from matformer.server.update_cache import UpdateCache
from matformer.server.update_log import UpdateLog


class CatchUp:
    def __init__(self, log: UpdateLog, checkpoints: CheckpointStore,
                 regions: Callable[[int], dict[str, Region]], tiers: Sequence[int], *,
                 logged: Callable[[int], range], latest: Callable[[], CheckpointRef],
                 wait: Callable[[int, float], None], tier_ids: TierIds = NO_MIXES) -> None:
        """``logged(r)``: the committed rounds from ``r`` on (UpdatesPruned before the log's
        start); ``latest()``: the latest listed checkpoint; ``wait(r, s)``: until round ``r``
        is committed, at most ``s`` seconds; ``tier_ids``: what the run's tier ids stand for."""
        self.updates = UpdateCache(read=log.read, regions=regions)
        self.checkpoints, self.tiers = checkpoints, tiers
        self.logged, self.latest, self.wait = logged, latest, wait
        self.tier_ids = tier_ids

    def closed(self, closed: ClosedRound) -> None:
        """A round the close just logged: served without reading it back."""
        self.updates.put(closed.update)

    def rounds(self, since_round: int, tier: int, wait_s: float = 0.0
               ) -> Iterator[list[Message]]:
        """The logged rounds from ``since_round`` on, each as its update messages cut to
        ``tier``, after waiting up to ``wait_s`` for ``since_round`` to close. NotARunTier
        for a tier the run lacks, UpdatesPruned for a round the log no longer holds (also
        one pruned while it is being sent)."""
        if tier not in self.tiers:
            raise NotARunTier(f"updates asked for at tier {tier}, which this run does not "
                              f"have (its tiers: {', '.join(map(str, self.tiers))}).")
        if wait_s > 0:
            self.wait(since_round, wait_s)
        rounds = self.logged(since_round)

        def messages() -> Iterator[list[Message]]:
            for round_index in rounds:
                try:
                    yield self.updates.messages(round_index, tier)
                except (OSError, CheckpointError):  # pruned since: a checkpoint holds it now
                    raise UpdatesPruned(
                        f"round {round_index} left the update log while it was being sent; "
                        "load the latest checkpoint (GetCheckpoint) and ask again.") from None
        return messages()

    def checkpoint(self, tier: int) -> ServedCheckpoint:
        """The latest universal checkpoint's manifest and its entry for ``tier``."""
        ref = self.latest()
        manifest = read_manifest(ref.path)
        named = self.tier_ids.resolve(tier)
        entry = manifest.entry(named) if manifest is not None else None
        return ServedCheckpoint(
            round=ref.round, manifest_path=f"{ref.path.name}/{MANIFEST_NAME}",
            entry=None if entry is None else ServedEntry(
                tier=tier_label(entry.tier), intermediate_size=entry.intermediate_size or 0,
                files=tuple(entry.files)))

    def chunks(self, path: str) -> Iterator[Message]:
        """A manifest or a file it lists, checked against its sha256 before and while it is
        read (``ServedFiles.chunks``)."""
        return served_files(self.checkpoints.root).chunks(path)
