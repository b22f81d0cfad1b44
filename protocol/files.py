"""Files on the wire: a file travels as ``FileChunk`` messages of ``CHUNK_BYTES`` (2 MiB,
well under gRPC's 4 MiB default message limit); the last chunk carries the sha256 of the
whole file. The receiver writes to a temporary file beside the destination and renames it
into place only once size and digest match, so a failed transfer leaves nothing behind."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from matformer.modeling.atomic import built_aside
from matformer.protocol.errors import ChecksumMismatch, MalformedStream, UnsafePath
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb

CHUNK_BYTES = 2 * 1024 * 1024
MAX_PATH_CHARS = 1024  # longer paths, or names over MAX_NAME_CHARS, are refused as unsafe
MAX_NAME_CHARS = 255  # the usual file-name limit: the OS would fail on longer ones


def send_file(path: Path, chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.FileChunk]:
    """The chunks of ``path`` in order; an empty file is one chunk without data. A missing
    file raises FileNotFoundError at the first chunk (check first, answer NOT_FOUND)."""
    total = path.stat().st_size
    digest = hashlib.sha256()
    offset = 0
    with path.open("rb") as handle:
        data = handle.read(chunk_bytes)
        while True:
            digest.update(data)
            following = handle.read(chunk_bytes) if data else b""  # look ahead to spot the last
            yield pb.FileChunk(offset=offset, total_size=total, data=data,
                               sha256="" if following else digest.hexdigest())
            if not following:
                return
            offset += len(data)
            data = following


def receive_file(chunks: Iterable[pb.FileChunk], dest: Path,
                 expected_sha256: str | None = None) -> str:
    """Reassemble ``chunks`` at ``dest`` atomically; return the file's sha256.

    Raises ``MalformedStream`` for gaps, overruns or a missing last chunk, and
    ``ChecksumMismatch`` when the data's digest is not the announced one (or
    ``expected_sha256``, e.g. the manifest's); after any failure ``dest`` is as it was.
    """
    with built_aside(dest) as staging:
        with staging.open("xb") as out:
            actual, announced = _write_chunks(chunks, out, dest.name)
        for source, wanted in (("the sender announced", announced),
                               ("the caller expected", expected_sha256)):
            if wanted is not None and wanted != actual:
                raise ChecksumMismatch(
                    f"{dest.name}: the data received has sha256 {actual} but {source} "
                    f"{wanted}; nothing was kept. Download it again."
                )
    return actual


def resolve_inside(root: Path, relative: str) -> Path:
    """``root / relative``, refusing absolute paths and any that leave ``root`` (``..``, links)."""
    if "\x00" in relative:  # os calls refuse it with a ValueError, not a missing file
        raise UnsafePath(f"{relative!r} holds a NUL character; ask for a path the manifest lists.")
    if len(relative) > MAX_PATH_CHARS or any(len(p) > MAX_NAME_CHARS for p in relative.split("/")):
        raise UnsafePath(f"a {len(relative)}-character path is longer than any checkpoint "
                         "file's; ask for a path the manifest lists.")
    base = root.resolve()
    target = (base / relative).resolve()
    if Path(relative).is_absolute() or not target.is_relative_to(base):
        raise UnsafePath(f"{relative!r} is not a path inside the run's checkpoint directory.")
    return target


def _write_chunks(chunks: Iterable[pb.FileChunk], out: BinaryIO, name: str) -> tuple[str, str]:
    """Write the chunks' data in order; return its sha256 and the one the last chunk announced."""
    sha = hashlib.sha256()
    offset, total, announced = 0, None, ""
    for chunk in chunks:
        if announced:
            raise MalformedStream(f"{name}: a chunk arrived after the last one.")
        if total is None:
            total = chunk.total_size
        if chunk.total_size != total or chunk.offset != offset:
            raise MalformedStream(
                f"{name}: a chunk at offset {chunk.offset} of a {chunk.total_size}-byte file does "
                f"not continue the {offset} of {total} bytes received so far."
            )
        if offset + len(chunk.data) > total:
            raise MalformedStream(f"{name}: the chunks run past the announced {total} bytes.")
        out.write(chunk.data)
        sha.update(chunk.data)
        offset += len(chunk.data)
        announced = chunk.sha256
    if not announced or offset != total:
        expected = "?" if total is None else total
        raise MalformedStream(
            f"{name}: the transfer stopped after {offset} of {expected} bytes, before the last "
            "chunk. Download it again."
        )
    return sha.hexdigest(), announced
