"""Which files make a checkpoint, fetched and checked against the manifest's sha256.

``ListedFiles`` is a checkpoint's ``config.json`` and weights as repository paths: from a
manifest entry (``listed``, which refuses an entry that lacks either, since loading whatever
else lies in the folder would load unverified files), or from a folder laid out as Hugging
Face lays it out (``in_folder``). ``fetch_listed`` fetches them through a ``Fetcher``, which
checks every file the manifest has a sha256 for. ``Unusable`` says why a slice cannot be
used: the loader raises its error under ``sliced`` and falls back under ``auto``.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matformer.modeling.checkpoint.files import (
    CONFIG_NAME,
    INDEX_NAME,
    WEIGHTS_NAME,
    is_weights_file,
    read_json,
)
from matformer.modeling.checkpoint.manifest import MANIFEST_NAME, Manifest, sha256_of
from matformer.modeling.checkpoint.repository import normalize
from matformer.modeling.errors import IncompleteTier, IntegrityError, MatformerError


class Unusable(Exception):
    """Why a slice cannot be used (``why``, for a log line) and the error to raise when
    nothing else may be loaded instead (``error``)."""

    def __init__(self, why: str, error: MatformerError) -> None:
        super().__init__(why)
        self.why = why
        self.error = error


class Fetcher:
    """Fetches repository files and checks each against the manifest's sha256 at once."""

    def __init__(self, repository: Any, manifest: Manifest | None, folder: str) -> None:
        self.repository = repository
        self.expected = {}
        if manifest is not None:
            self.expected = {normalize(name, folder): digest
                             for name, digest in manifest.sha256.items()}

    def one(self, path: str) -> Path | None:
        local = self.repository.fetch(path)
        if local is not None and path in self.expected and sha256_of(local) != self.expected[path]:
            raise IntegrityError(
                f"{path} does not match the sha256 in {MANIFEST_NAME} (file changed or "
                "corrupted); delete it and fetch it again, or re-export the tiers."
            )
        return local

    def all(self, paths: list[str]) -> tuple[dict[str, Path], list[str]]:
        found, missing = {}, []
        for path in paths:
            local = self.one(path)
            if local is None:
                missing.append(path)
            else:
                found[path] = local
        return found, missing


@dataclass(slots=True)
class ListedFiles:
    """A checkpoint's files, as repository paths: its config.json and its weights."""

    config: str
    weights: list[str]  # model.safetensors, or the index then its shards

    @property
    def paths(self) -> list[str]:
        return [self.config, *self.weights]

    def weight_names(self) -> list[str]:
        """The weights as names inside the config's folder (what ``read_weights`` takes)."""
        folder = posixpath.dirname(self.config)
        return [posixpath.relpath(w, folder) if folder else w for w in self.weights]


def listed(paths: list[str], what: str) -> ListedFiles:
    """The config and weights among the paths a manifest entry lists for ``what``."""
    configs = [p for p in paths if posixpath.basename(p) == CONFIG_NAME]
    weights = sorted((p for p in paths if is_weights_file(p)),
                     key=lambda p: (posixpath.basename(p) != INDEX_NAME, p))
    names = [posixpath.basename(w) for w in weights]
    gaps = []
    if len(configs) != 1:
        gaps.append(f"{len(configs)} config.json files" if configs else "no config.json")
    if not weights:
        gaps.append(f"no weights ({WEIGHTS_NAME} or {INDEX_NAME})")
    elif INDEX_NAME not in names and names != [WEIGHTS_NAME]:
        gaps.append(f"shards without their {INDEX_NAME}")
    elif configs and any(posixpath.dirname(w) != posixpath.dirname(configs[0])
                         for w in weights):
        gaps.append("weights outside its config.json's folder")
    if gaps:
        why = f"the manifest's entry for {what} lists {' and '.join(gaps)}"
        raise Unusable(why, IncompleteTier(f"{why}; re-export the tiers."))
    return ListedFiles(configs[0], weights)


def in_folder(folder: str, fetcher: Fetcher) -> ListedFiles | None:
    """A folder's checkpoint as Hugging Face lays it out (no manifest to say which files);
    None when it has no config.json."""
    config = posixpath.join(folder, CONFIG_NAME)
    if fetcher.repository.fetch(config) is None:
        return None
    index = fetcher.one(posixpath.join(folder, INDEX_NAME))
    if index is None:
        return ListedFiles(config, [posixpath.join(folder, WEIGHTS_NAME)])
    shards = sorted(set(read_json(index).get("weight_map", {}).values()))
    return ListedFiles(config, [posixpath.join(folder, n) for n in (INDEX_NAME, *shards)])


def fetch_listed(files: ListedFiles, common: list[str], fetcher: Fetcher, what: str
                 ) -> dict[str, Path]:
    """Fetch and verify ``files`` and ``common`` (repository path → local file); every
    shard the index names must be among the listed weights."""
    found, missing = fetcher.all(files.paths + common)
    if missing:
        raise Unusable(f"missing {', '.join(missing)}", IncompleteTier(
            f"{what} is incomplete; missing: {', '.join(missing)}. Fetch or re-export them, "
            "or use --load-strategy auto."))
    index = files.weights[0]
    if posixpath.basename(index) == INDEX_NAME:
        folder = posixpath.dirname(index)
        named = {posixpath.join(folder, n)
                 for n in read_json(found[index]).get("weight_map", {}).values()}
        unlisted = sorted(named - set(files.weights))
        if unlisted:
            why = f"its index names shards the manifest does not list: {', '.join(unlisted)}"
            raise Unusable(why, IncompleteTier(f"{what}: {why}; re-export the tiers."))
    return found
