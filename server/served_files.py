"""Which files of the run's ``checkpoints/`` the coordinator serves, and the sha256 of each.

A path is served only if it is a checkpoint's manifest or a file some manifest lists with its
sha256 (paths relative to the manifest's folder, as the loader reads them); temp files, stray
files and anything else are not. A listed file is checked against the manifest before it is
sent (digests are cached by size, mtime and inode, so repeated downloads do not rehash) and
again while it streams: ``send_file`` hashes the bytes it actually read, and a file rewritten
under the transfer is cut off with DATA_LOSS instead of ending as good (``read``, for HTTP,
likewise withholds a whole file's last bytes unless they hash to its manifest's digest).

    files = served_files(coordinator.dir / "checkpoints")   # one per directory, gRPC and HTTP
    path, sha256 = files.verified("round-4/tier1/model.safetensors")
    for chunk in files.chunks("round-4/matformer_manifest.json"): ...
    files.by_sha256(sha256)                  # "round-4/tier1/model.safetensors" (or a twin)
    for data in files.read("round-4/tier1/model.safetensors", 0, size): ...
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from matformer.modeling.checkpoint.files import read_json
from matformer.modeling.checkpoint.manifest import MANIFEST_NAME, Manifest, sha256_of
from matformer.modeling.checkpoint.repository import normalize
from matformer.modeling.errors import MatformerError
from matformer.protocol.files import resolve_inside, send_file
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.server.errors import FileNotServed, ServedFileDamaged

log = logging.getLogger("matformer.server")
Stamp = tuple[int, int, int]  # (size, mtime_ns, inode): a file unchanged since it was read
READ_BYTES = 2**20  # what ``read`` hands on at a time


class ServedFiles:
    """The manifests under ``root`` and the files they list; safe to share between threads."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._lock = threading.Lock()
        self._manifests: dict[str, tuple[Stamp, dict[str, str]]] = {}  # path → listed files
        self._digests: dict[str, tuple[Stamp, str]] = {}

    def expected(self, relative: str) -> tuple[Path, str | None]:
        """The file for ``relative`` and the sha256 it must have (None for a manifest).

        Raises ``UnsafePath`` for a path leaving ``root``, ``FileNotServed`` for any other
        path that is neither a manifest nor listed in one."""
        path = resolve_inside(self.root, relative)
        name = path.relative_to(self.root.resolve()).as_posix() if path.is_file() else None
        listed = self._listed()
        if name is not None and name in listed:
            return path, listed[name]
        raise FileNotServed(
            f"{relative} is not served: only checkpoint manifests ({MANIFEST_NAME}) and the "
            "files they list with a sha256 are; take paths from the manifest.")

    def verified(self, relative: str) -> tuple[Path, str | None]:
        """``expected``, after checking the file on disk against its sha256: a file that does
        not match raises ``ServedFileDamaged`` (and is logged)."""
        path, wanted = self.expected(relative)
        if wanted is not None:
            try:
                actual = self._digest(path)
            except FileNotFoundError as err:  # removed since: a checkpoint being rewritten
                raise FileNotServed(f"{relative} was removed; ask for the manifest again.") from err
            if actual != wanted:
                raise self._damaged(relative, actual, wanted)
        return path, wanted

    def chunks(self, relative: str) -> Iterator[pb.FileChunk]:
        """The file's ``FileChunk`` messages, once ``verified``; the digest of what was read
        must be the manifest's too, or the last chunk is never sent."""
        path, wanted = self.verified(relative)
        try:
            for chunk in send_file(path):
                if chunk.sha256 and wanted is not None and chunk.sha256 != wanted:
                    raise self._damaged(relative, chunk.sha256, wanted, " while it was sent")
                yield chunk
        except FileNotFoundError as err:
            raise FileNotServed(f"{relative} was removed; ask for the manifest again.") from err

    def by_sha256(self, digest: str) -> str | None:
        """A listed file whose manifest gives it ``digest`` (files of equal bytes are one),
        None when no manifest lists it."""
        return next((name for name, sha256 in self._listed().items() if sha256 == digest),
                    None)

    def read(self, relative: str, start: int, stop: int) -> Iterator[bytes]:
        """Bytes ``start`` to ``stop`` of a listed file once ``verified``, from the very file
        that was hashed (its size, mtime and inode unchanged since). When that is the whole
        file, the bytes read must hash to its manifest's digest, or the last of them is never
        handed on: ``ServedFileDamaged`` cuts the transfer off instead."""
        with open(self.expected(relative)[0], "rb") as handle:
            path, wanted = self.verified(relative)  # the path now, after the file was opened
            if _stamp_of(handle) != _stamp(path) or _stamp(path)[0] < stop:
                raise FileNotServed(f"{relative} changed while it was opened; ask again.")
            digest = hashlib.sha256() if (start, stop) == (0, _stamp(path)[0]) else None
            handle.seek(start)
            held = b""  # the last bytes read, handed on once the next ones are in
            for left in range(stop - start, 0, -READ_BYTES):
                data = handle.read(min(READ_BYTES, left))
                if len(data) != min(READ_BYTES, left):
                    raise FileNotServed(f"{relative} was cut short while it was sent.")
                if digest is not None:
                    digest.update(data)
                if held:
                    yield held
                held = data
            if digest is not None and wanted is not None and digest.hexdigest() != wanted:
                raise self._damaged(relative, digest.hexdigest(), wanted, " while it was sent")
            if held:
                yield held

    def _listed(self) -> dict[str, str | None]:
        """Every servable path (relative to ``root``) → its sha256, None for manifests."""
        found: dict[str, tuple[Stamp, dict[str, str]]] = {}
        for path in sorted(self.root.glob(f"*/{MANIFEST_NAME}")):
            if path.parent.name.startswith("."):  # staging or retired copies being written
                continue
            key = path.relative_to(self.root).as_posix()
            try:
                now = _stamp(path)
                with self._lock:
                    cached = self._manifests.get(key)
                found[key] = cached if cached and cached[0] == now else (now, _read(path))
            except (OSError, ValueError, MatformerError) as err:
                log.warning("checkpoint manifest %s is unreadable (%s); its files are not served",
                            path, err)
        with self._lock:
            self._manifests = found
        listed: dict[str, str | None] = {}
        for key, (_, files) in found.items():
            listed.update(files)
            listed[key] = None
        return listed

    def _digest(self, path: Path) -> str:
        key, now = str(path), _stamp(path)
        with self._lock:
            cached = self._digests.get(key)
        if cached and cached[0] == now:
            return cached[1]
        digest = sha256_of(path)
        if _stamp(path) == now:  # not changed while hashed
            with self._lock:
                self._digests[key] = (now, digest)
        return digest

    def _damaged(self, relative: str, actual: str, wanted: str, when: str = ""
                 ) -> ServedFileDamaged:
        message = (f"the server's copy of {relative} has sha256 {actual}{when}, but its manifest "
                   f"lists {wanted}; it is not served. Restore the checkpoint or write it again.")
        log.error(message)
        return ServedFileDamaged(message)


@functools.cache
def served_files(root: Path) -> ServedFiles:
    """The one ``ServedFiles`` of a checkpoints directory, so gRPC and HTTP share its caches."""
    return ServedFiles(root)


def _read(manifest_path: Path) -> dict[str, str]:
    """The files a manifest lists with a sha256, as paths relative to the checkpoints root."""
    manifest = Manifest.from_dict(read_json(manifest_path), str(manifest_path))
    folder = manifest_path.parent.name
    return {normalize(name, folder): digest for name, digest in manifest.sha256.items()}


def _stamp(path: Path) -> Stamp:
    info = os.stat(path)
    return info.st_size, info.st_mtime_ns, info.st_ino


def _stamp_of(handle: BinaryIO) -> Stamp:
    info = os.fstat(handle.fileno())
    return info.st_size, info.st_mtime_ns, info.st_ino
