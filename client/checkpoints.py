"""Loading the run's checkpoint for this client's tier.

    replica = load_replica(broadcast, checkpoint, tier, strategy="auto", cache=...,
                           mirror=open_mirror("server"), device=device, schema_hash=...)

The checkpoint loader resolves the coordinator's checkpoint through its manifest for the tier
and ``--load-strategy`` (the slice when the manifest lists it, else the universal checkpoint
sliced at load) and reads each file through ``CheckpointFiles``: from a local cache, from a
mirror (``--checkpoint``: a folder or hub copy of the run's checkpoints), or downloaded from
the coordinator, always checked against the manifest's sha256. A download goes through
``connection``: a ``Connection`` (gRPC), or a ``Broadcast`` that takes each file the manifest
lists from an HTTP ``--mirror`` by its sha256 first (client/mirror.py).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path, PurePosixPath

import torch

from matformer.client.connection import Connection, PublishedCheckpoint
from matformer.client.errors import ClientError, DamagedTransfer, NotServed
from matformer.client.mirror import Broadcast
from matformer.client.replica import Replica
from matformer.modeling.checkpoint.files import read_json
from matformer.modeling.checkpoint.loader import load, resolve
from matformer.modeling.checkpoint.manifest import MANIFEST_NAME, Manifest, sha256_of
from matformer.modeling.checkpoint.repository import HubRepository, LocalRepository, normalize
from matformer.modeling.checkpoint.schema import canonical_schema_hash
from matformer.modeling.errors import MatformerError, PathEscapesRepository
from matformer.protocol.errors import ChecksumMismatch, MalformedStream

DOWNLOAD_ATTEMPTS = 3  # of a checkpoint file that arrives damaged, before giving up
Mirror = LocalRepository | HubRepository
Source = Connection | Broadcast  # what downloads a file: the same ``download`` either way


def open_mirror(source: str) -> Mirror | None:
    """The repository ``--checkpoint`` names: None for ``server``, a hub repository for
    ``hf:ORG/NAME``, else a local folder."""
    if source == "server":
        return None
    if source.startswith("hf:"):
        return HubRepository(source.removeprefix("hf:"))
    path = Path(source).expanduser()
    if not path.is_dir():
        raise ClientError(f"--checkpoint {source} is neither 'server', a folder nor "
                          "hf:ORG/NAME; point it at a copy of the run's checkpoints.")
    return LocalRepository(path)


def load_replica(connection: Source, checkpoint: PublishedCheckpoint, tier: int, *,
                 strategy: str, cache: Path, mirror: Mirror | None, device: torch.device,
                 schema_hash: str, log: Callable[[str], None],
                 trust_remote_code: bool = False) -> Replica:
    """The replica of ``checkpoint`` at ``tier``, on ``device``; refuses a model whose
    canonical schema hash is not the run's ``schema_hash`` (when given), and one built with
    module files the checkpoint carries unless the operator passed ``trust_remote_code``."""
    files = CheckpointFiles(connection, cache, mirror, log=log)
    resolved = resolve(checkpoint.folder, tier, strategy, repository=files,
                       trust_remote_code=trust_remote_code)
    replica = Replica(load(resolved).to(device))
    got = canonical_schema_hash(replica.config, replica.shapes)
    if schema_hash and got != schema_hash:
        raise ClientError(f"the checkpoint {checkpoint.folder} loads a model with canonical "
                          f"schema hash {got}, the run's is {schema_hash}; its files do not "
                          "belong to this run.")
    fetched = f"{len(files.downloaded)} files downloaded" + (
        f", {len(files.mirrored)} from {mirror}" if files.mirrored else "")
    parameters = sum(p.numel() for p in replica.model.parameters())
    log(f"loaded {checkpoint.folder} ({resolved.used}: {resolved.reason}; {fetched}); "
        f"{parameters:,} parameters")
    return replica


class CheckpointFiles:
    """The run's ``checkpoints/`` directory as a repository for the checkpoint loader.

    ``fetch(path)`` answers a local copy under ``cache``: a cached file whose sha256 the
    manifest confirms, else one from ``mirror`` that the manifest confirms, else a download
    from the coordinator. The manifest itself always comes from the coordinator. The loader
    checks every sha256 again before use. A download that arrives damaged (its sha256 is not
    the announced or the manifest's one, or it is cut short) is refused and fetched again, up
    to ``DOWNLOAD_ATTEMPTS`` times; each retry goes to ``log``.
    """

    def __init__(self, connection: Source, cache: Path, mirror: Mirror | None = None,
                 log: Callable[[str], None] = lambda line: None) -> None:
        self.connection = connection
        self.log = log
        self.cache = Path(cache)
        self.mirror = mirror
        self.expected: dict[str, str] = {}
        self.downloaded: list[str] = []  # paths that came over gRPC, for the log
        self.mirrored: list[str] = []  # paths copied from the mirror

    def fetch(self, path: str) -> Path | None:
        local = self._inside_cache(path)
        if path.rpartition("/")[2] == MANIFEST_NAME:
            if not self._download(path, local, None):
                return None
            manifest = Manifest.from_dict(read_json(local), f"the coordinator's {path}")
            folder = path.rpartition("/")[0]
            self.expected = {normalize(name, folder): digest
                             for name, digest in manifest.sha256.items()}
            return local
        wanted = self.expected.get(path)
        if wanted is not None and local.is_file() and sha256_of(local) == wanted:
            return local
        if wanted is not None and self.mirror is not None:
            found = self._from_mirror(path)
            if found is not None and sha256_of(found) == wanted:
                local.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(found, local)
                self.mirrored.append(path)
                return local
        return local if self._download(path, local, wanted) else None

    def _inside_cache(self, path: str) -> Path:
        """Where ``path`` is kept here. Paths come from the coordinator (its checkpoint folder
        and manifest), so each is checked to stay inside the cache, whatever it says."""
        local = self.cache / path
        if (PurePosixPath(path).is_absolute() or ".." in PurePosixPath(path).parts
                or not local.resolve().is_relative_to(self.cache.resolve())):
            raise PathEscapesRepository(
                f"the coordinator names the checkpoint file {path!r}, which leads outside this "
                f"client's cache {self.cache}; nothing was written. The coordinator is "
                "misconfigured or hostile: ask its operator, or join another run.")
        return local

    def _from_mirror(self, path: str) -> Path | None:
        try:
            return self.mirror.fetch(path)
        except (OSError, MatformerError):
            return None

    def _download(self, path: str, local: Path, sha256: str | None) -> bool:
        """Download ``path`` to ``local``; False if the coordinator does not serve it."""
        for attempt in range(1, DOWNLOAD_ATTEMPTS + 1):
            try:
                self.connection.download(path, local, sha256)
            except NotServed:
                return False
            except (ChecksumMismatch, MalformedStream) as err:
                damaged = err
                self.log(f"refused download {attempt} of {DOWNLOAD_ATTEMPTS} of {path}, it "
                         f"arrived damaged: {err}")
                continue
            self.downloaded.append(path)
            return True
        raise DamagedTransfer(
            f"{path} arrived damaged on all {DOWNLOAD_ATTEMPTS} downloads (the last: {damaged}) "
            "Something between the client and the coordinator corrupts data (a proxy, a faulty "
            "link), or the checkpoint was rewritten meanwhile: check the connection and run the "
            "client again.")
