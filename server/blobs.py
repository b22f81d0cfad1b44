"""The broadcast as immutable HTTP resources, so that any cache can carry it
(docs/operations.md, "A mirror or cache for the broadcast"):

- ``GET /updates?since_round=R&tier=T[&wait_s=S]``: the logged rounds from R on (at most
  ``MAX_INDEX``; ``more`` says there are others after them), each as ``round``, ``tier``,
  ``sha256``, ``bytes`` and ``url`` of its blob; ``wait_s`` holds the answer until round R
  commits, as GetUpdates' ``wait_seconds`` does. A round not committed yet is absent. Never
  cached (``Cache-Control: no-store``).
- ``GET /blobs/sha256/{hex}`` (and ``HEAD``): the bytes whose sha256 is ``hex``. Either one
  round's update cut to one tier, encoded as the GetUpdates stream carries it, each
  ``UpdateMessage`` framed as a 4-byte big-endian length and its serialized bytes
  (``server.update_cache.framed``), or a checkpoint file some manifest lists under that
  digest, checked against it before (and, sent whole, while) it is sent.

A blob never changes, so it is served with ``ETag: "<hex>"``, ``Cache-Control: public,
max-age=31536000, immutable``, ``Accept-Ranges: bytes`` and its ``Content-Length``; one
``Range: bytes=a-b`` (``a-``, ``-n``) gets 206 and ``Content-Range`` (416 when it lies past
the end), a matching ``If-None-Match`` 304. An unknown digest is 404 with ``Cache-Control:
no-store``, so no cache keeps the miss. ``BlobStore.served`` counts the bodies sent per
digest, and ``/metrics`` their totals: behind a cache, each blob's body leaves once.

A body leaves in pieces of ``CHUNK_BYTES``, views of the cached blob or of a file's reads,
never a copy of the whole: a connection holds at most a piece or two beyond its socket's
buffers, whatever its client reads. One client address is sent at most [server]
``http_streams_per_client`` bodies at once (``BlobStore.streams`` counts them; 503 and
``Retry-After`` beyond), and a client that takes no bytes for ``http_send_timeout_s`` is
dropped (server/http.py), its slot and buffers with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi.concurrency import iterate_in_threadpool, run_in_threadpool
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from matformer.modeling.errors import CheckpointError
from matformer.server.coordinator import Coordinator
from matformer.server.errors import FileNotServed, NotARunTier, ServedFileDamaged, UpdatesPruned
from matformer.server.served_files import ServedFiles
from matformer.server.service import MAX_WAIT_S
from matformer.server.update_cache import UpdateCache

MAX_INDEX = 64  # rounds one index answer lists
IMMUTABLE = "public, max-age=31536000, immutable"
NO_STORE = {"Cache-Control": "no-store"}
SHA256 = re.compile(r"[0-9a-f]{64}")
RANGE = re.compile(r"bytes=(\d*)-(\d*)")  # one range; several are answered with all bytes
CHUNK_BYTES = 64 * 1024  # a body's piece: what one connection holds beyond its socket
RETRY_AFTER_S = 5  # told to a client refused for the blobs it is already being sent


class UpdateEntry(BaseModel):
    round: int
    tier: int
    sha256: str  # lowercase hex, of the blob's bytes
    bytes: int
    url: str  # /blobs/sha256/<sha256>, on this server or any mirror of it


class UpdateIndex(BaseModel):
    updates: list[UpdateEntry]  # consecutive rounds, oldest first
    more: bool  # cut at MAX_INDEX: ask again from the round after the last


@dataclass(frozen=True, slots=True)
class Body:
    """A blob's bytes: how many, and a reader of bytes ``start`` to ``stop`` (which may
    block: a file's)."""

    kind: Literal["update", "file"]
    size: int
    read: Callable[[int, int], Iterator[bytes | memoryview]]


class BlobStore:
    """What the URLs above serve: round updates from the ``UpdateCache`` that GetUpdates
    reads, checkpoint files from ``ServedFiles``."""

    def __init__(self, coordinator: Coordinator, updates: UpdateCache, files: ServedFiles,
                 streams_per_client: int) -> None:
        self.coordinator = coordinator
        self.updates = updates
        self.files = files
        self.streams_per_client = streams_per_client
        self.served: Counter[str] = Counter()  # sha256 → bodies sent (200 or 206)
        self.sent: Counter[str] = Counter()  # kind → bodies sent
        self.streams: Counter[str] = Counter()  # client address → bodies being sent now
        self._lock = threading.Lock()

    def check_tier(self, tier: int) -> None:
        allowed = self.coordinator.config.tiers.ids()
        if tier not in allowed:
            raise NotARunTier(f"updates asked for at tier {tier}, which this run does not have "
                              f"(its tiers: {', '.join(map(str, allowed))}).")

    def index(self, since_round: int, tier: int) -> UpdateIndex:
        """Raises ``NotARunTier`` and ``UpdatesPruned``."""
        self.check_tier(tier)
        rounds = self.coordinator.logged_rounds(since_round)
        try:
            blobs = [self.updates.blob(r, tier) for r in rounds[:MAX_INDEX]]
        except (OSError, CheckpointError) as err:
            raise UpdatesPruned(f"a round from {since_round} on left the update log ({err}); "
                                "load the latest checkpoint and ask again.") from None
        return UpdateIndex(more=len(rounds) > MAX_INDEX, updates=[UpdateEntry(
            round=b.round, tier=b.tier, sha256=b.sha256, bytes=len(b.data),
            url=f"/blobs/sha256/{b.sha256}") for b in blobs])

    def body(self, digest: str) -> Body | None:
        """The bytes named ``digest``, None if nothing here has that sha256. Raises
        ``ServedFileDamaged`` for a checkpoint file that no longer matches its manifest."""
        blob = self.updates.find(digest)
        if blob is not None:
            view = memoryview(blob.data)  # pieces of it are sent, never a copy
            return Body("update", len(view), lambda start, stop: iter([view[start:stop]]))
        relative = self.files.by_sha256(digest)
        if relative is None:
            return None
        try:
            path, _ = self.files.verified(relative)
            size = path.stat().st_size
        except (FileNotServed, OSError):  # removed since its manifest was read
            return None
        return Body("file", size, lambda start, stop: self.files.read(relative, start, stop))

    def open_stream(self, client: str, digest: str, body: Body) -> bool:
        """Count a body sent to ``client`` (an address); False, counting nothing, when it is
        sent ``streams_per_client`` already."""
        with self._lock:
            if self.streams[client] >= self.streams_per_client:
                return False
            self.streams[client] += 1
            self.served[digest] += 1
            self.sent[body.kind] += 1
            return True

    def close_stream(self, client: str) -> None:
        with self._lock:
            self.streams -= Counter({client: 1})  # an address sent nothing leaves the count

    def prometheus(self, run: str) -> list[str]:
        with self._lock:
            sent = dict(self.sent)
        return ["# HELP matformer_blob_bodies_served_total Blob bodies sent (/blobs/), by kind.",
                "# TYPE matformer_blob_bodies_served_total counter",
                *(f'matformer_blob_bodies_served_total{{{run},kind="{kind}"}} {sent.get(kind, 0)}'
                  for kind in ("update", "file"))]


class Commits:
    """Index requests waiting for a round to commit, as tasks on the event loop rather than a
    thread each; every close wakes them (``Coordinator.round_closed``)."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None  # set (and replaced) by the next close
        coordinator.round_closed.append(lambda closed: self._wake())

    async def wait(self, round_index: int, timeout_s: float) -> None:
        """Until round ``round_index`` is committed, the run finished, or ``timeout_s``."""
        loop = self._loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not self._committed(round_index):
            if self._event is None:
                self._event = asyncio.Event()
            try:
                await asyncio.wait_for(self._event.wait(), deadline - loop.time())
            except TimeoutError:
                return

    def _committed(self, round_index: int) -> bool:
        state = self._coordinator.state  # read without the lock: a close holds it long
        return state.round > round_index or state.finished

    def _wake(self) -> None:
        """(the close's thread, the coordinator's lock held) Wake the waiting tasks on their
        loop; never raises, or the close would stop half done."""
        loop = self._loop
        with contextlib.suppress(RuntimeError):  # the loop closed: the server is stopping
            if loop is not None:
                loop.call_soon_threadsafe(self._pulse)

    def _pulse(self) -> None:
        event, self._event = self._event, None
        if event is not None:
            event.set()


def blob_router(store: BlobStore) -> APIRouter:
    router = APIRouter()
    commits = Commits(store.coordinator)

    @router.get("/updates", response_model=UpdateIndex)
    async def updates(since_round: int = Query(ge=0), tier: int = Query(ge=0),
                      wait_s: float = Query(0.0, ge=0.0)) -> Response:
        try:
            store.check_tier(tier)
            if wait_s > 0:
                await commits.wait(since_round, min(wait_s, MAX_WAIT_S))
            # logged_rounds takes the coordinator's lock: never on the event loop
            index = await run_in_threadpool(store.index, since_round, tier)
        except NotARunTier as err:
            raise HTTPException(status_code=404, detail=str(err), headers=NO_STORE) from err
        except UpdatesPruned as err:
            raise HTTPException(status_code=410, detail=str(err), headers=NO_STORE) from err
        return Response(index.model_dump_json(), media_type="application/json",
                        headers=NO_STORE)

    @router.get("/blobs/sha256/{digest}")
    @router.head("/blobs/sha256/{digest}")
    def blob(digest: str, request: Request) -> Response:
        try:
            body = store.body(digest) if SHA256.fullmatch(digest) else None
        except ServedFileDamaged as err:
            raise HTTPException(status_code=500, detail=str(err), headers=NO_STORE) from err
        if body is None:
            raise HTTPException(status_code=404, headers=NO_STORE, detail=(
                f"no blob has sha256 {digest[:64]!r} here: take digests (lowercase hex) from "
                "/updates or a checkpoint manifest; a round that left the update log is in "
                "the latest checkpoint."))
        return ranged(request, digest, body, store)

    return router


def ranged(request: Request, digest: str, body: Body, store: BlobStore) -> Response:
    """The answer to a GET or HEAD of ``body``: 304, 416, 206 or 200, whose body ``store``
    counts (or 503 when its client is sent too many already)."""
    etag = f'"{digest}"'
    headers = {"ETag": etag, "Cache-Control": IMMUTABLE, "Accept-Ranges": "bytes"}
    if _matches(request.headers.get("if-none-match"), etag):
        return Response(status_code=304, headers=headers)
    start, stop, status = 0, body.size, 200
    if request.headers.get("if-range", etag) == etag:  # a validator of other bytes: all
        try:
            span = byte_range(request.headers.get("range"), body.size)
        except ValueError:
            return Response(status_code=416, headers={
                **NO_STORE, "Content-Range": f"bytes */{body.size}"})
        if span is not None:
            (start, stop), status = span, 206
            headers["Content-Range"] = f"bytes {start}-{stop - 1}/{body.size}"
    headers["Content-Length"] = str(stop - start)
    if request.method == "HEAD":
        return Response(status_code=status, headers=headers,
                        media_type="application/octet-stream")
    return BlobStream(store, digest, body, (start, stop), status_code=status, headers=headers,
                      media_type="application/octet-stream")


class BlobStream(StreamingResponse):
    """Bytes ``span`` of ``body`` in pieces, as one of its client's streams in ``store``:
    taken when the answer starts, given back however it ends (sent, the client gone, or
    dropped by the send timeout); 503 instead when the client has no stream left."""

    def __init__(self, store: BlobStore, digest: str, body: Body, span: tuple[int, int],
                 **response: Any) -> None:
        super().__init__(pieces(body.read(*span)), **response)
        self.store, self.digest, self.body = store, digest, body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = scope["client"][0] if scope.get("client") else ""
        if not self.store.open_stream(client, self.digest, self.body):
            busy = JSONResponse({"detail": (
                f"{client} is sent {self.store.streams_per_client} blobs at once already "
                f"([server] http_streams_per_client); ask again once one has arrived, or take "
                "the broadcast from a cache of this server (docs/operations.md).")},
                status_code=503, headers={**NO_STORE, "Retry-After": str(RETRY_AFTER_S),
                                          "Connection": "close"})  # its slot, at once
            await busy(scope, receive, send)
            return
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.store.close_stream(client)


async def pieces(reads: Iterator[bytes | memoryview]) -> AsyncIterator[memoryview]:
    """What ``reads`` yields (on a worker thread: a file's reads block), as views of at most
    ``CHUNK_BYTES``."""
    async for data in iterate_in_threadpool(reads):
        view = memoryview(data)
        for at in range(0, len(view), CHUNK_BYTES):
            yield view[at:at + CHUNK_BYTES]


def byte_range(header: str | None, size: int) -> tuple[int, int] | None:
    """(start, stop) of one ``bytes=`` range of ``size`` bytes; None to send them all (no
    header, several ranges, or one that does not parse, which RFC 9110 lets a server
    ignore); ValueError when it starts past the end (416)."""
    found = RANGE.fullmatch(header.strip()) if header is not None else None
    if found is None or found.group(1) == found.group(2) == "":
        return None
    first, last = found.groups()
    if first == "":  # the last n bytes
        if int(last) == 0 or size == 0:
            raise ValueError("an empty suffix")
        return max(size - int(last), 0), size
    if last != "" and int(last) < int(first):
        return None
    if int(first) >= size:
        raise ValueError("past the end")
    return int(first), size if last == "" else min(int(last) + 1, size)


def _matches(if_none_match: str | None, etag: str) -> bool:
    """``If-None-Match`` names this blob (weak comparison, as RFC 9110 asks for it)."""
    if if_none_match is None:
        return False
    tags = [tag.strip().removeprefix("W/") for tag in if_none_match.split(",")]
    return "*" in tags or etag in tags
