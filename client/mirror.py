"""The broadcast through a mirror: ``matformer-client --mirror URL`` (docs/operations.md, "A
mirror or cache for the broadcast").

URL is the base of any HTTP server or cache that serves the coordinator's HTTP side, or a copy
of it (server/blobs.py). A member asks it for the index of the rounds it lacks
(``/updates?since_round=R&tier=T``), takes each round's blob from
``/blobs/sha256/<hex>``, checks that the bytes hash to that digest, and reads them with the
GetUpdates stream's own decoder (``read_updates``). Checkpoint files come from
``/blobs/sha256/<the manifest's digest>`` the same way.

The coordinator stays the authority. The index's digests come from the mirror: they catch
damage on the way (a cache, a proxy, a disk), not a mirror that forges both. So a member
asks the coordinator which rounds have closed, and their headers alone (``headers_only``:
weight hash, rule, parameter updates), and takes a round from the mirror only when the
mirror lists it with that header; after applying it, the replica's hash must be the
coordinator's (``Broadcast.disagreed``). Checkpoint files are checked against the digests of
a manifest the coordinator sent. Whatever the mirror gets wrong (no answer in time, an
error, bytes that are not what they claim, rounds it withholds or lists otherwise) sends
that download to the coordinator over gRPC instead, said once in the log; the mirror is
left alone a minute, twice as long after each failure in a row (up to an hour).

    broadcast = Broadcast(connection, "http://cache.example:8080", log=print)
    broadcast.updates(since_round, tier, wait_s=20.0)    # as Connection.updates
    broadcast.download(path, dest, sha256)               # as Connection.download
    broadcast.disagreed(round_index)                     # the replica's hash was not the
                                                         # coordinator's after that round
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from http.client import HTTPException
from pathlib import Path
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from matformer.client.connection import Connection
from matformer.client.errors import ClientError
from matformer.modeling.atomic import built_aside
from matformer.modeling.compression import RoundUpdate
from matformer.protocol.errors import MalformedStream
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.updates import RoundHeader, read_updates

TIMEOUT_S = 60.0  # for the mirror's answer to start, and between its reads
MIRROR_REST_S = 60.0  # after the mirror failed, how long downloads skip it
MIRROR_REST_MAX_S = 3600.0  # the rest doubles with each failure in a row, up to this
READ_BYTES = 2**20
LENGTH_BYTES = 4  # a frame's length prefix in a round's blob: unsigned, big-endian
SHA256 = re.compile(r"[0-9a-f]{64}")
T = TypeVar("T")


class MirrorFailed(ClientError):
    """The mirror did not answer, or answered with what the coordinator did not publish; the
    download goes to the coordinator instead. The message says what the mirror did."""


class HttpMirror:
    def __init__(self, url: str, *, timeout_s: float = TIMEOUT_S) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ClientError(f"--mirror {url!r} is not an http:// or https:// URL; give the "
                              "base URL of a server or cache of the coordinator's HTTP side, "
                              "e.g. http://cache.example:8080.")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.update_bytes = 0  # UpdateMessage bytes taken from the mirror

    def updates(self, since_round: int, tier: int, *, wait_s: float = 0.0
                ) -> list[RoundUpdate]:
        """The logged round updates from ``since_round`` on, cut to ``tier``, as
        ``Connection.updates`` gives them; [] also when the coordinator no longer logs
        ``since_round``. Raises ``MirrorFailed``."""
        return [update for update, _ in self.rounds(since_round, tier, wait_s=wait_s)]

    def rounds(self, since_round: int, tier: int, *, wait_s: float = 0.0
               ) -> list[tuple[RoundUpdate, list[pb.UpdateMessage]]]:
        """As ``updates``, each round's update with the GetUpdates messages it came as,
        checked by decoding them (a relay passes them on). Raises ``MirrorFailed``."""
        updates: list[tuple[RoundUpdate, list[pb.UpdateMessage]]] = []
        while True:
            entries, more = self._index(since_round + len(updates), tier,
                                        wait_s if not updates else 0)
            for entry in entries:
                messages = list(unframed(self._blob(entry["sha256"], entry["bytes"])))
                try:
                    got = list(read_updates(messages, tier))
                except MalformedStream as err:
                    raise MirrorFailed(f"round {entry['round']}'s blob: {err}") from None
                if [u.round for u in got] != [entry["round"]]:
                    raise MirrorFailed(f"the blob listed for round {entry['round']} holds "
                                       f"rounds {[u.round for u in got]}.")
                self.update_bytes += sum(m.ByteSize() for m in messages)
                updates.append((got[0], messages))
            if not more or not entries:
                return updates

    def download(self, sha256: str, dest: Path) -> None:
        """The blob ``sha256`` to ``dest`` (atomically), checked. Raises ``MirrorFailed``."""
        with built_aside(dest) as staging, staging.open("xb") as out:
            for data in self._fetch(f"/blobs/sha256/{sha256}", sha256, None):
                out.write(data)

    def _index(self, since_round: int, tier: int, wait_s: float
               ) -> tuple[list[dict[str, Any]], bool]:
        query = urllib.parse.urlencode({"since_round": since_round, "tier": tier,
                                        "wait_s": wait_s})
        try:
            body = json.loads(b"".join(self._get(f"/updates?{query}", wait_s)))
        except urllib.error.HTTPError as err:
            if err.code == 410:  # pruned: the coordinator's gRPC answer says what to load
                return [], False
            raise MirrorFailed(f"/updates answered {err.code} {err.reason}") from None
        except (OSError, HTTPException, ValueError) as err:
            raise MirrorFailed(f"/updates: {err}") from None
        try:
            entries, more = body["updates"], body["more"]
            for n, entry in enumerate(entries):
                if (entry["round"], entry["tier"]) != (since_round + n, tier) or not (
                        isinstance(entry["bytes"], int) and entry["bytes"] >= 0
                        and SHA256.fullmatch(entry["sha256"])):
                    raise ValueError(f"entry {n} is {entry}")
        except (KeyError, TypeError, ValueError) as err:
            raise MirrorFailed(f"/updates is not the index of rounds from {since_round} at "
                               f"tier {tier}: {err}") from None
        return entries, bool(more)

    def _blob(self, sha256: str, size: int) -> bytes:
        return b"".join(self._fetch(f"/blobs/sha256/{sha256}", sha256, size))

    def _fetch(self, path: str, sha256: str, size: int | None) -> Iterator[bytes]:
        """The body of ``path``, checked to hash to ``sha256`` (and be ``size`` bytes long):
        the last of it is handed on only then."""
        digest, held, got = hashlib.sha256(), b"", 0
        try:
            for data in self._get(path, 0.0):
                digest.update(data)
                got += len(data)
                if size is not None and got > size:
                    raise MirrorFailed(f"{path} runs past the {size} bytes the index lists.")
                if held:
                    yield held
                held = data
        except urllib.error.HTTPError as err:
            raise MirrorFailed(f"{path} answered {err.code} {err.reason}") from None
        except (OSError, HTTPException) as err:
            raise MirrorFailed(f"{path}: {err}") from None
        if digest.hexdigest() != sha256:
            raise MirrorFailed(f"{path} came as {got} bytes with sha256 {digest.hexdigest()}.")
        if held:
            yield held

    def _get(self, path: str, wait_s: float) -> Iterator[bytes]:
        request = urllib.request.Request(self.url + path, headers={"Accept-Encoding": "identity"})
        with urllib.request.urlopen(request, timeout=self.timeout_s + wait_s) as reply:
            while data := reply.read(READ_BYTES):
                yield data


def unframed(blob: bytes) -> Iterator[pb.UpdateMessage]:
    """The messages of a round's blob (``server.update_cache.framed``). Raises
    ``MirrorFailed`` for frames that run past its end or do not parse."""
    view, offset = memoryview(blob), 0
    while offset < len(blob):
        length = int.from_bytes(view[offset:offset + LENGTH_BYTES], "big")
        offset += LENGTH_BYTES
        if offset + length > len(blob):
            raise MirrorFailed(f"a frame of {length} bytes runs past the blob's end.")
        try:
            yield pb.UpdateMessage.FromString(view[offset:offset + length].tobytes())
        except DecodeError as err:
            raise MirrorFailed(f"a frame is no UpdateMessage: {err}") from None
        offset += length


class MirrorFirst:
    """The mirror first when there is one, the coordinator without one and whenever the
    mirror fails: a member's broadcast (``Broadcast``) and a relay's (relay/cache.py)."""

    def __init__(self, mirror: str | None, log: Callable[[str], None]) -> None:
        self.mirror = HttpMirror(mirror) if mirror else None
        self.log = log
        self.fallbacks = 0  # downloads the mirror failed, taken from the coordinator
        self._failures = 0  # in a row: each doubles the rest
        self._resting_until = 0.0  # a mirror that failed is left alone until then

    @property
    def ready(self) -> bool:
        """There is a mirror, and it is not resting after a failure."""
        return self.mirror is not None and time.monotonic() >= self._resting_until

    def take(self, what: str, from_mirror: Callable[[HttpMirror], T],
             from_coordinator: Callable[[], T]) -> T:
        """``from_mirror(mirror)`` when it answers with something, else
        ``from_coordinator()``: an empty answer from the mirror is no answer (a round that
        did not close in time, a log that no longer reaches back, a stale copy), so the
        coordinator's is final."""
        if self.ready:
            try:
                got = from_mirror(self.mirror)
            except MirrorFailed as err:
                self.failed(what, err)
            else:
                if got:
                    self.answered()
                    return got
        return from_coordinator()

    def answered(self) -> None:
        """The mirror's answer was taken: the next failure rests it for ``MIRROR_REST_S``."""
        self._failures = 0

    def failed(self, what: str, err: MirrorFailed) -> None:
        """A mirror that hangs or lies would cost every download its timeout or a check:
        after a failure the broadcast comes from the coordinator for ``MIRROR_REST_S``,
        twice as long after each failure in a row, then the mirror is tried again."""
        self.fallbacks += 1
        self._failures += 1
        rest = min(MIRROR_REST_S * 2 ** (self._failures - 1), MIRROR_REST_MAX_S)
        self._resting_until = time.monotonic() + rest
        if self.fallbacks == 1:
            self.log(f"the mirror {self.mirror.url} failed for {what}: "
                     f"{str(err).rstrip('.')}; taking the broadcast from the coordinator "
                     f"over gRPC, and the mirror again after "
                     f"{MIRROR_REST_S:g} s, twice as long after each failure in a row (said "
                     "once)")


class Broadcast:
    """Where this member takes the broadcast from: the mirror when one is given, the
    coordinator over gRPC without one and whenever the mirror fails. The coordinator is the
    authority on every round."""

    def __init__(self, connection: Connection, mirror: str | None,
                 log: Callable[[str], None] = lambda line: None) -> None:
        self.connection = connection
        self.source = MirrorFirst(mirror, log)
        self._mirrored: set[int] = set()  # rounds taken from the mirror, not yet applied
        self._refused_through = -1  # the mirror got this round wrong: none up to it from it

    @property
    def mirror(self) -> HttpMirror | None:
        return self.source.mirror

    @property
    def fallbacks(self) -> int:
        return self.source.fallbacks

    @property
    def update_bytes(self) -> int:
        """UpdateMessage bytes received, from the mirror and over gRPC."""
        return self.connection.update_bytes + (self.mirror.update_bytes if self.mirror else 0)

    def updates(self, since_round: int, tier: int, *, wait_s: float = 0.0
                ) -> list[RoundUpdate]:
        """``Connection.updates``, through the mirror when there is one: the coordinator
        says which rounds have closed and their headers (waiting up to ``wait_s`` for
        ``since_round``'s close), and the mirror must list each of them with that header.
        A mirror that fails, withholds a round or lists it otherwise is a failure
        (``MirrorFailed``): those rounds come from the coordinator."""
        if not self.source.ready or since_round <= self._refused_through:
            return self.connection.updates(since_round, tier, wait_s=wait_s)
        published = self.connection.published(since_round, tier, wait_s=wait_s)
        if not published:
            return []
        try:
            got = self.mirror.updates(since_round, tier)[:len(published)]
            same_rounds(got, published, tier)
        except MirrorFailed as err:
            self.source.failed(f"updates from round {since_round}", err)
            return self.connection.updates(since_round, tier)
        self.source.answered()
        self._mirrored = {r for r in self._mirrored if r >= since_round} | {
            update.round for update in got}
        return got

    def disagreed(self, round_index: int) -> None:
        """After ``round_index`` the replica's hash is not the coordinator's: when the round
        came from the mirror, its steps were not the coordinator's: the member reloads and
        replays through it from the coordinator (whether or not the mirror still rests)."""
        if round_index in self._mirrored:
            self._mirrored.discard(round_index)
            self._refused_through = round_index
            self.source.failed(f"round {round_index}", MirrorFailed(
                f"its update of round {round_index} carries the coordinator's header, but "
                "applying it left the replica's weight hash unlike the coordinator's."))

    def download(self, path: str, dest: Path, sha256: str | None = None) -> str:
        """``Connection.download``; a file the manifest gives a sha256 comes from the mirror
        when there is one."""
        if sha256 is None:
            return self.connection.download(path, dest, sha256)
        return self.source.take(
            path, lambda mirror: mirror.download(sha256, dest) or sha256,
            lambda: self.connection.download(path, dest, sha256))


def same_rounds(got: list[RoundUpdate], published: list[RoundHeader], tier: int) -> None:
    """Raises ``MirrorFailed`` unless the mirror's rounds are those the coordinator
    ``published``, each with its header (a member's broadcast and a relay's check)."""
    if len(got) < len(published):
        raise MirrorFailed(
            f"it lists {len(got)} rounds from round {published[0].round} on, while the "
            f"coordinator has closed {len(published)} (through round {published[-1].round}).")
    for update, header in zip(got, published, strict=True):
        listed = RoundHeader.of(update, tier)
        if listed != header:
            raise MirrorFailed(f"it lists round {header.round} with {_described(listed)}; the "
                               f"coordinator published {_described(header)}.")


def _described(header: RoundHeader) -> str:
    return (f"{header.parameters} parameter updates ({header.update.rule}, lr "
            f"{header.update.lr:g}, weight decay {header.update.weight_decay:g}) and weight "
            f"hash {header.weight_hash[:12] or '(none)'}")
