"""``matformer_manifest.json``, schema v1: which files make each tier, and their sha256.

Paths are relative to the manifest's directory; tier slices usually sit beside the universal
checkpoint (``../name-tier1/model.safetensors``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modeling.errors import ManifestError

MANIFEST_NAME = "matformer_manifest.json"
SCHEMA_VERSION = 1


@dataclass(kw_only=True, slots=True)
class TierEntry:
    """The files of one tier (tier 0: the universal checkpoint)."""

    tier: int
    intermediate_size: int
    files: list[str]

    def to_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "intermediate_size": self.intermediate_size,
                "files": list(self.files)}


@dataclass(kw_only=True, slots=True)
class Manifest:
    base_intermediate_size: int
    common_files: list[str] = field(default_factory=list)
    tiers: list[TierEntry] = field(default_factory=list)
    sha256: dict[str, str] = field(default_factory=dict)  # path → hex digest

    def entry(self, tier: int) -> TierEntry | None:
        return next((e for e in self.tiers if e.tier == tier), None)

    def available_tiers(self) -> list[int]:
        return sorted(e.tier for e in self.tiers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "matformer_base_intermediate_size": self.base_intermediate_size,
            "common_files": list(self.common_files),
            "tiers": [e.to_dict() for e in sorted(self.tiers, key=lambda e: e.tier)],
            "sha256": dict(sorted(self.sha256.items())),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = MANIFEST_NAME) -> Manifest:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ManifestError(
                f"{source} has schema_version {version!r}; this Matformer reads version "
                f"{SCHEMA_VERSION}. Re-export the tiers with this version, or upgrade Matformer."
            )
        try:
            tiers = [
                TierEntry(tier=int(e["tier"]), intermediate_size=int(e["intermediate_size"]),
                          files=[str(f) for f in e["files"]])
                for e in data["tiers"]
            ]
            return cls(
                base_intermediate_size=int(data["matformer_base_intermediate_size"]),
                common_files=[str(f) for f in data.get("common_files", [])],
                tiers=tiers,
                sha256={str(k): str(v) for k, v in data.get("sha256", {}).items()},
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ManifestError(
                f"{source} is malformed ({type(err).__name__}: {err}); re-export the tiers."
            ) from err


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
