"""GetUpdates served from memory: the encoded messages of recent rounds, per tier.

Every client of a tier downloads the same messages for a round, so each (round, tier) is
encoded once, when the first client asks, from the update the close handed over (``put``:
the newest round only) or read from the update log, cut to the tier's regions. The HTTP side
(server/blobs.py) serves the same messages as one blob, ``framed``, at a URL named by its
sha256: it is framed once too, when first asked for. Messages and blobs stay for the newest
rounds as long as they fit in ``budget`` bytes (at least the newest round's, whatever its
size); a round that left is read and encoded again if a client replays that far, into the
same bytes. Nothing here takes the coordinator's lock, so a download never holds up a
heartbeat or a close.

    cache = UpdateCache(read=log.read, regions=coordinator.regions)
    coordinator.round_closed.append(lambda closed: cache.put(closed.update))
    for message in cache.messages(round_index, tier): ...
    blob = cache.blob(round_index, tier)     # blob.data, blob.sha256
    cache.find(blob.sha256)                  # the same blob again, by its digest
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from matformer.modeling.compression import Region, RoundUpdate
from matformer.modeling.errors import CheckpointError
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.updates import update_messages

CACHE_BYTES = 512 * 2**20  # encoded messages and blobs kept, newest rounds first
LENGTH_BYTES = 4  # a frame's length prefix: unsigned, big-endian
Key = tuple[int, int]  # (round, tier)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class UpdateBlob:
    """One round's update cut to one tier, as the bytes of ``framed``."""

    round: int
    tier: int
    data: bytes
    sha256: str  # of ``data``, lowercase hex


def framed(messages: Iterable[pb.UpdateMessage]) -> bytes:
    """The blob of a round: each message of its GetUpdates stream in order, as its length
    (``LENGTH_BYTES``, unsigned big-endian) then its deterministic serialization.
    client/mirror.py reads it back."""
    frames = []
    for message in messages:
        data = message.SerializeToString(deterministic=True)
        frames += [len(data).to_bytes(LENGTH_BYTES, "big"), data]
    return b"".join(frames)


class UpdateCache:
    def __init__(self, *, read: Callable[[int], RoundUpdate],
                 regions: Callable[[int], dict[str, Region]], budget: int = CACHE_BYTES
                 ) -> None:
        self._read = read
        self._regions = regions
        self._budget = budget
        self._newest: RoundUpdate | None = None
        self._messages: dict[Key, list[pb.UpdateMessage]] = {}
        self._blobs: dict[Key, UpdateBlob] = {}
        self._sizes: dict[Key, int] = {}  # bytes held per key: its messages and blob
        self._digests: dict[str, Key] = {}  # every blob framed so far
        self._lock = threading.Lock()
        self._making: dict[tuple[str, Key], threading.Lock] = {}  # one maker per item

    def put(self, update: RoundUpdate) -> None:
        """A round the close just logged: served without reading it back."""
        with self._lock:
            self._newest = update

    def messages(self, round_index: int, tier: int) -> list[pb.UpdateMessage]:
        """The round's header and parameter updates cut to ``tier``'s regions. Raises what
        the update log raises for a round it no longer holds (OSError, CheckpointError)."""
        return self._once(self._messages, (round_index, tier), self._encode)

    def blob(self, round_index: int, tier: int) -> UpdateBlob:
        """``messages`` framed, with their sha256; raises as ``messages`` does."""
        return self._once(self._blobs, (round_index, tier), self._frame)

    def find(self, sha256: str) -> UpdateBlob | None:
        """The blob with this digest among those framed since the server started (a round's
        ``blob`` makes its digest known); None for any other digest, and for a round the
        update log no longer holds."""
        with self._lock:
            key = self._digests.get(sha256)
        if key is None:
            return None
        try:
            blob = self.blob(*key)
        except (OSError, CheckpointError):  # pruned from the log since: served no more
            return None
        return blob if blob.sha256 == sha256 else None

    def _encode(self, key: Key) -> tuple[list[pb.UpdateMessage], int]:
        round_index, tier = key
        with self._lock:
            newest = self._newest
        logged = newest if newest is not None and newest.round == round_index else None
        if logged is None:
            logged = self._read(round_index)
        messages = list(update_messages([logged.cut(tier, self._regions(tier))]))
        return messages, sum(m.ByteSize() for m in messages)

    def _frame(self, key: Key) -> tuple[UpdateBlob, int]:
        data = framed(self.messages(*key))
        blob = UpdateBlob(round=key[0], tier=key[1], data=data,
                          sha256=hashlib.sha256(data).hexdigest())
        with self._lock:
            self._digests[blob.sha256] = key
        return blob, len(data)

    def _once(self, store: dict[Key, T], key: Key, make: Callable[[Key], tuple[T, int]]) -> T:
        """``store[key]``, made by the first thread that asks while the others wait for it."""
        with self._lock:
            if key in store:
                return store[key]
            maker = self._making.setdefault((make.__name__, key), threading.Lock())
        with maker:
            with self._lock:
                if key in store:
                    return store[key]
            value, size = make(key)
            with self._lock:
                store[key] = value
                self._sizes[key] = self._sizes.get(key, 0) + size
                self._evict()
                self._making.pop((make.__name__, key), None)
            return value

    def _evict(self) -> None:
        """(lock held) Drop the oldest rounds' messages and blobs while they exceed the
        budget; the newest round's stay."""
        newest = max(r for r, _ in self._sizes)
        total = sum(self._sizes.values())
        for key in sorted(self._sizes):  # oldest round first
            if total <= self._budget or key[0] == newest:
                break
            total -= self._sizes.pop(key)
            self._messages.pop(key, None)
            self._blobs.pop(key, None)
