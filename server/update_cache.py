"""GetUpdates served from memory: the encoded messages of recent rounds, per tier.

Every client of a tier downloads the same messages for a round, so each (round, tier) is
encoded once, when the first client asks, from the update the close handed over (``put``) or,
for an older round, read once from the update log. The newest ``rounds`` rounds stay; older
ones are read and encoded again if a client replays that far. Nothing here takes the
coordinator's lock, so a download never holds up a heartbeat or a close.

    cache = UpdateCache(read=log.read, regions=coordinator.regions)
    coordinator.round_closed.append(lambda closed: cache.put(closed.update))
    for message in cache.messages(round_index, tier): ...
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import torch

from modeling.compression import Aggregate, Region, region_slices
from protocol.matformer.v1 import coordinator_pb2 as pb
from protocol.updates import RoundUpdate, update_messages
from server.update_log import LoggedUpdate

CACHED_ROUNDS = 8  # a client this far behind replays from memory; one further reads the log


class UpdateCache:
    def __init__(self, *, read: Callable[[int], LoggedUpdate],
                 regions: Callable[[int], dict[str, Region]], rounds: int = CACHED_ROUNDS
                 ) -> None:
        self._read = read
        self._regions = regions
        self._rounds = rounds
        self._logged: OrderedDict[int, LoggedUpdate] = OrderedDict()
        self._encoded: dict[tuple[int, int], list[pb.UpdateMessage]] = {}
        self._lock = threading.Lock()
        self._encoding: dict[tuple[int, int], threading.Lock] = {}  # one encoder per key

    def put(self, update: LoggedUpdate) -> None:
        """A round the close just logged: served without reading it back."""
        with self._lock:
            self._logged[update.round] = update
            self._evict()

    def messages(self, round_index: int, tier: int) -> list[pb.UpdateMessage]:
        """The round's header and parameter updates cut to ``tier``'s regions. Raises what
        the update log raises for a round it no longer holds (OSError, CheckpointError)."""
        key = (round_index, tier)
        with self._lock:
            if key in self._encoded:
                return self._encoded[key]
            encoder = self._encoding.setdefault(key, threading.Lock())
        with encoder:  # clients of one tier asking at once: the first encodes, the rest wait
            with self._lock:
                if key in self._encoded:
                    return self._encoded[key]
                logged = self._logged.get(round_index)
            if logged is None:
                logged = self._read(round_index)
            messages = list(update_messages([RoundUpdate(
                round=logged.round, learning_rate=logged.update.lr,
                weight_hash=logged.hashes.get(tier, ""),
                parameters=_within(logged.aggregates, self._regions(tier)),
                signs_only=logged.update.rule == "sign")]))
            with self._lock:
                self._encoded[key] = messages
                self._logged.setdefault(round_index, logged)
                self._evict()
                self._encoding.pop(key, None)
            return messages

    def _evict(self) -> None:
        """(lock held) Keep the newest ``rounds`` rounds, decoded and encoded."""
        newest = sorted(self._logged, reverse=True)[:self._rounds]
        keep = set(newest)
        for round_index in [r for r in self._logged if r not in keep]:
            del self._logged[round_index]
        for key in [k for k in self._encoded if k[0] not in keep]:
            del self._encoded[key]


def _within(aggregates: dict[str, Aggregate], regions: dict[str, Region]
            ) -> dict[str, Aggregate]:
    """The aggregates cut to a tier's regions: a client downloads only what it holds."""
    cut = {}
    for name, agg in aggregates.items():
        where = region_slices(regions[name])
        if tuple(agg.tokens[where].shape) == tuple(agg.tokens.shape):
            cut[name] = agg
            continue
        tokens = torch.zeros_like(agg.tokens)
        tokens[where] = agg.tokens[where]
        if bool((tokens > 0).any()):
            cut[name] = Aggregate(values=agg.values, tokens=tokens)
    return cut
