"""``matformer_manifest.json``, schema v1: which files make each tier, and their sha256.

Paths are relative to the manifest's directory; tier slices usually sit beside the universal
checkpoint (``../name-tier1/model.safetensors``).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modeling.errors import ManifestError, ManifestVersionError
from modeling.matformer import Tier, tier_label

MANIFEST_NAME = "matformer_manifest.json"
SCHEMA_VERSION = 1


@dataclass(kw_only=True, slots=True)
class TierEntry:
    """The files of one tier (tier 0: the universal checkpoint) or Mix'n'Match slice.

    A Mix'n'Match entry has ``layer_tiers`` and, as its ``tier``, the label "mix:0,0,1,2";
    its ``intermediate_size`` is the widest (first) layer's.
    """

    tier: int | str
    intermediate_size: int
    files: list[str]
    layer_tiers: list[int] | None = None

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"tier": self.tier, "intermediate_size": self.intermediate_size,
                                "files": list(self.files)}
        if self.layer_tiers is not None:
            data["layer_tiers"] = list(self.layer_tiers)
        return data


@dataclass(kw_only=True, slots=True)
class Manifest:
    base_intermediate_size: int
    common_files: list[str] = field(default_factory=list)
    tiers: list[TierEntry] = field(default_factory=list)
    sha256: dict[str, str] = field(default_factory=dict)  # path → hex digest

    def entry(self, tier: Tier) -> TierEntry | None:
        """The entry for a tier, or for a Mix'n'Match list of per-layer tiers."""
        wanted = tier if isinstance(tier, int) else tier_label(tier)
        return next((e for e in self.tiers if e.tier == wanted), None)

    def available_tiers(self) -> list[str]:
        ints = sorted(e.tier for e in self.tiers if isinstance(e.tier, int))
        mixes = sorted(e.tier for e in self.tiers if isinstance(e.tier, str))
        return [str(t) for t in ints] + mixes

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "matformer_base_intermediate_size": self.base_intermediate_size,
            "common_files": list(self.common_files),
            "tiers": [e.to_dict() for e in sorted(self.tiers, key=lambda e: str(e.tier))],
            "sha256": dict(sorted(self.sha256.items())),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = MANIFEST_NAME) -> Manifest:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ManifestVersionError(
                f"{source} has schema_version {version!r}; this Matformer reads version "
                f"{SCHEMA_VERSION}. Re-export the tiers with this version, or upgrade Matformer."
            )
        try:
            tiers = [
                TierEntry(
                    tier=str(e["tier"]) if "layer_tiers" in e else int(e["tier"]),
                    intermediate_size=int(e["intermediate_size"]),
                    files=[str(f) for f in e["files"]],
                    layer_tiers=[int(t) for t in e["layer_tiers"]] if "layer_tiers" in e else None,
                )
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
