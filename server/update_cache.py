"""GetUpdates served from memory: the encoded messages of recent rounds, per tier.

Every client of a tier downloads the same messages for a round, so each (round, tier) is
encoded once, when the first client asks, from the update the close handed over (``put``:
the newest round only) or read from the update log, cut to the tier's regions. Encoded
messages stay for the newest rounds as long as they fit in ``budget`` bytes (at least the
newest round's, whatever its size); a round that left is read and encoded again if a client
replays that far. Nothing here takes the coordinator's lock, so a download never holds up a
heartbeat or a close.

    cache = UpdateCache(read=log.read, regions=coordinator.regions)
    coordinator.round_closed.append(lambda closed: cache.put(closed.update))
    for message in cache.messages(round_index, tier): ...
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from matformer.modeling.compression import Region, RoundUpdate
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.updates import update_messages

CACHE_BYTES = 512 * 2**20  # encoded messages kept, newest rounds first


class UpdateCache:
    def __init__(self, *, read: Callable[[int], RoundUpdate],
                 regions: Callable[[int], dict[str, Region]], budget: int = CACHE_BYTES
                 ) -> None:
        self._read = read
        self._regions = regions
        self._budget = budget
        self._newest: RoundUpdate | None = None
        self._encoded: dict[tuple[int, int], tuple[list[pb.UpdateMessage], int]] = {}
        self._lock = threading.Lock()
        self._encoding: dict[tuple[int, int], threading.Lock] = {}  # one encoder per key

    def put(self, update: RoundUpdate) -> None:
        """A round the close just logged: served without reading it back."""
        with self._lock:
            self._newest = update

    def messages(self, round_index: int, tier: int) -> list[pb.UpdateMessage]:
        """The round's header and parameter updates cut to ``tier``'s regions. Raises what
        the update log raises for a round it no longer holds (OSError, CheckpointError)."""
        key = (round_index, tier)
        with self._lock:
            if key in self._encoded:
                return self._encoded[key][0]
            encoder = self._encoding.setdefault(key, threading.Lock())
        with encoder:  # clients of one tier asking at once: the first encodes, the rest wait
            with self._lock:
                if key in self._encoded:
                    return self._encoded[key][0]
                newest = self._newest
            logged = newest if newest is not None and newest.round == round_index else None
            if logged is None:
                logged = self._read(round_index)
            messages = list(update_messages([logged.cut(tier, self._regions(tier))]))
            with self._lock:
                self._encoded[key] = (messages, sum(m.ByteSize() for m in messages))
                self._evict()
                self._encoding.pop(key, None)
            return messages

    def _evict(self) -> None:
        """(lock held) Drop the oldest rounds' messages while they exceed the budget; the
        newest round's stay."""
        newest = max(r for r, _ in self._encoded)
        total = sum(size for _, size in self._encoded.values())
        for key in sorted(self._encoded):  # oldest round first
            if total <= self._budget or key[0] == newest:
                break
            total -= self._encoded.pop(key)[1]

