"""Where checkpoint files come from: a local folder or a Hugging Face hub repository.

Both answer one question, ``fetch(path)``: the local file for a repository-relative path, or
None if the repository has no such file. The hub repository downloads exactly the files it is
asked for, so a client fetches only its tier.
"""

from __future__ import annotations

import posixpath
from pathlib import Path, PurePosixPath

from matformer.modeling.errors import PathEscapesRepository


def normalize(path: str, base: str = "") -> str:
    """A manifest path made relative to the repository root.

    ``path`` is relative to the folder ``base`` (the manifest's folder, itself relative to the
    root). ``./`` is dropped; ``..`` climbs from ``base`` but never above the root (it is
    clamped there); absolute and empty paths are rejected.
    """
    if not path or not path.strip():
        raise PathEscapesRepository("the manifest lists an empty path; re-export the tiers.")
    if path.startswith(("/", "\\")) or (len(path) > 1 and path[1] == ":"):
        raise PathEscapesRepository(
            f"the manifest lists the absolute path {path!r}; manifest paths must be relative "
            "to the manifest's folder. Re-export the tiers."
        )
    if all(part == "." for part in PurePosixPath(path.replace("\\", "/")).parts):
        raise PathEscapesRepository(f"the manifest path {path!r} names no file.")
    parts: list[str] = []
    for part in PurePosixPath(base, path.replace("\\", "/")).parts:
        if part == "..":
            if parts:
                parts.pop()
        elif part != ".":
            parts.append(part)
    if not parts:
        raise PathEscapesRepository(f"the manifest path {path!r} names no file.")
    return posixpath.join(*parts)


class LocalRepository:
    """Files under a local root folder; symlinks may not lead outside it."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root).resolve()

    def __str__(self) -> str:
        return str(self.root)

    def fetch(self, path: str) -> Path | None:
        target = (self.root / path).resolve()
        if not target.is_relative_to(self.root):
            raise PathEscapesRepository(
                f"{path!r} leads to {target}, outside the repository {self.root}; "
                "remove the link or copy the file into the repository."
            )
        return target if target.is_file() else None


def is_repo_id(source: str) -> bool:
    """``org/name``, and no such path here: a Hugging Face hub repository id."""
    return source.count("/") == 1 and not Path(source).expanduser().exists() \
        and all(source.split("/"))


class HubRepository:
    """Files of a Hugging Face hub repository, downloaded on demand into the hub cache."""

    def __init__(
        self, repo_id: str, revision: str | None = None, cache_dir: Path | None = None
    ) -> None:
        self.repo_id = repo_id
        self.revision = revision
        self.cache_dir = cache_dir

    def __str__(self) -> str:
        return f"hub:{self.repo_id}" + (f"@{self.revision}" if self.revision else "")

    def fetch(self, path: str) -> Path | None:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

        try:
            return Path(hf_hub_download(
                self.repo_id, path, revision=self.revision, cache_dir=self.cache_dir
            ))
        except (EntryNotFoundError, LocalEntryNotFoundError):
            return None
