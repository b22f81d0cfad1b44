"""Files in chunks: order, sha256, atomic reassembly, and nothing left behind on failure."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from matformer.protocol.errors import ChecksumMismatch, MalformedStream, UnsafePath
from matformer.protocol.files import CHUNK_BYTES, receive_file, resolve_inside, send_file
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb


def _file(tmp_path: Path, size: int) -> tuple[Path, bytes]:
    data = os.urandom(size)
    path = tmp_path / "src" / "model.safetensors"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return path, data


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


@pytest.mark.parametrize("size", [0, 1, 999, 1000, 2500])
def test_round_trip_in_chunks(tmp_path: Path, size: int) -> None:
    src, data = _file(tmp_path, size)
    chunks = list(send_file(src, chunk_bytes=1000))
    assert [c.offset for c in chunks] == [i * 1000 for i in range(max(1, -(-size // 1000)))]
    assert all(c.total_size == size for c in chunks)
    assert [bool(c.sha256) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    dest = tmp_path / "out" / "model.safetensors"
    digest = receive_file(chunks, dest, expected_sha256=hashlib.sha256(data).hexdigest())
    assert digest == hashlib.sha256(data).hexdigest() and dest.read_bytes() == data
    assert _leftovers(dest.parent) == ["model.safetensors"]


def test_default_chunks_stay_well_under_grpc_limits() -> None:
    assert CHUNK_BYTES == 2 * 1024 * 1024


def _corrupt(chunks: list[pb.FileChunk]) -> list[pb.FileChunk]:
    chunks[1].data = bytes([chunks[1].data[0] ^ 1]) + chunks[1].data[1:]
    return chunks


def _tampered_digest(chunks: list[pb.FileChunk]) -> list[pb.FileChunk]:
    chunks[-1].sha256 = "0" * 64
    return chunks


def _resized(chunks: list[pb.FileChunk]) -> list[pb.FileChunk]:
    chunks[1].total_size += 1
    return chunks


def _overrun(chunks: list[pb.FileChunk]) -> list[pb.FileChunk]:
    chunks[-1].data += b"x"
    return chunks


FAILURES = {
    "corrupt data": (_corrupt, ChecksumMismatch, "the sender announced"),
    "forged digest": (_tampered_digest, ChecksumMismatch, "nothing was kept"),
    "gap": (lambda c: c[:1] + c[2:], MalformedStream, "does not continue"),
    "no last chunk": (lambda c: c[:-1], MalformedStream, "stopped after 2000 of 2500"),
    "empty stream": (lambda c: [], MalformedStream, "stopped after 0 of \\?"),
    "after the last": (lambda c: [*c, c[-1]], MalformedStream, "after the last one"),
    "size changes": (_resized, MalformedStream, "does not continue"),
    "overrun": (_overrun, MalformedStream, "run past"),
}


@pytest.mark.parametrize(("damage", "error", "match"), FAILURES.values(), ids=FAILURES.keys())
def test_a_failed_transfer_leaves_the_destination_as_it_was(tmp_path: Path, damage, error,
                                                             match: str) -> None:
    src, _ = _file(tmp_path, 2500)
    dest = tmp_path / "out" / "model.safetensors"
    dest.parent.mkdir()
    dest.write_bytes(b"previous version")
    with pytest.raises(error, match=match):
        receive_file(damage(list(send_file(src, chunk_bytes=1000))), dest)
    assert dest.read_bytes() == b"previous version"
    assert _leftovers(dest.parent) == ["model.safetensors"]


def test_a_digest_other_than_the_expected_one_is_refused(tmp_path: Path) -> None:
    src, _ = _file(tmp_path, 10)
    dest = tmp_path / "out" / "model.safetensors"
    with pytest.raises(ChecksumMismatch, match="the caller expected " + "a" * 64):
        receive_file(send_file(src), dest, expected_sha256="a" * 64)
    assert _leftovers(dest.parent) == []


def test_a_broken_connection_leaves_nothing_behind(tmp_path: Path) -> None:
    src, _ = _file(tmp_path, 2500)

    def interrupted() -> Iterator[pb.FileChunk]:
        yield next(send_file(src, chunk_bytes=1000))
        raise ConnectionError("stream reset")

    dest = tmp_path / "out" / "model.safetensors"
    with pytest.raises(ConnectionError):
        receive_file(interrupted(), dest)
    assert _leftovers(dest.parent) == []


def test_resolve_inside_refuses_paths_that_escape(tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    (root / "round-2").mkdir(parents=True)
    (root / "escape").symlink_to(tmp_path)
    inside = resolve_inside(root, "round-2/../round-2/x.json")
    assert inside == root.resolve() / "round-2" / "x.json"
    for bad in ("../state.json", "/etc/passwd", str(root / "x"), "escape/secret"):
        with pytest.raises(UnsafePath, match="not a path inside"):
            resolve_inside(root, bad)
