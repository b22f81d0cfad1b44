"""``matformer_manifest.json``, schema v1: which files make each tier, and their sha256.

Paths are relative to the manifest's directory: Matformer puts tier slices inside the
universal checkpoint (``tier1/model.safetensors``), psyche-elastic beside it
(``../name-tier1/model.safetensors``). The layout is psyche-elastic's, so either
project reads the other's manifests:

- ``tiers``: one entry per integer tier (``tier``, ``intermediate_size``, ``files``);
- ``mix_n_match``: Matformer's own key, one entry per Mix'n'Match slice (``layer_tiers``
  instead of ``tier``). Readers that know only ``tiers`` skip it;
- ``common_files``: files every tier uses (tokenizer, custom code), in the manifest's folder;
- ``sha256``: path → hex digest, for every file above.

``intermediate_size`` and ``matformer_base_intermediate_size`` may be left out, as psyche's
schema allows: each follows from the other and the tier (width = base / 2**tier).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matformer.modeling.errors import ManifestError, ManifestVersionError
from matformer.modeling.matformer import Tier, tier_label

MANIFEST_NAME = "matformer_manifest.json"
SCHEMA_VERSION = 1
MIX_N_MATCH_KEY = "mix_n_match"


@dataclass(kw_only=True, slots=True)
class TierEntry:
    """The files of one tier (tier 0: the universal checkpoint) or Mix'n'Match slice.

    ``tier`` is an integer, or for a Mix'n'Match slice the tuple of per-layer tiers;
    ``intermediate_size`` is the widest (first) layer's width, None when the manifest leaves
    it out and no base width is known either.
    """

    tier: int | tuple[int, ...]
    intermediate_size: int | None
    files: list[str]

    @property
    def is_mix(self) -> bool:
        return isinstance(self.tier, tuple)

    def to_dict(self) -> dict[str, Any]:
        key: dict[str, Any] = (
            {"layer_tiers": list(self.tier)} if self.is_mix else {"tier": self.tier}
        )
        width = {} if self.intermediate_size is None else {
            "intermediate_size": self.intermediate_size}
        return {**key, **width, "files": list(self.files)}


@dataclass(kw_only=True, slots=True)
class Manifest:
    base_intermediate_size: int | None
    common_files: list[str] = field(default_factory=list)
    tiers: list[TierEntry] = field(default_factory=list)  # integer tiers and Mix'n'Match
    sha256: dict[str, str] = field(default_factory=dict)  # path → hex digest

    def entry(self, tier: Tier) -> TierEntry | None:
        """The entry for a tier, or for a Mix'n'Match list of per-layer tiers."""
        wanted = tier if isinstance(tier, int) else tuple(tier)
        return next((e for e in self.tiers if e.tier == wanted), None)

    def available_tiers(self) -> list[str]:
        ints = sorted(e.tier for e in self.tiers if not e.is_mix)
        mixes = sorted(e.tier for e in self.tiers if e.is_mix)
        return [tier_label(t) for t in ints] + [tier_label(t) for t in mixes]

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
        if self.base_intermediate_size is not None:
            data["matformer_base_intermediate_size"] = self.base_intermediate_size
        data["common_files"] = list(self.common_files)
        data["tiers"] = [e.to_dict() for e in sorted(
            (e for e in self.tiers if not e.is_mix), key=lambda e: e.tier)]
        mixes = sorted((e for e in self.tiers if e.is_mix), key=lambda e: e.tier)
        if mixes:
            data[MIX_N_MATCH_KEY] = [e.to_dict() for e in mixes]
        data["sha256"] = dict(sorted(self.sha256.items()))
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = MANIFEST_NAME) -> Manifest:
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ManifestVersionError(
                f"{source} has schema_version {version!r}; this Matformer reads version "
                f"{SCHEMA_VERSION}. Re-export the tiers with this version, or upgrade Matformer."
            )
        try:
            base = data.get("matformer_base_intermediate_size")
            base = None if base is None else _count(base, "matformer_base_intermediate_size")
            entries = [_entry(e, mix=False) for e in _list(data, "tiers")]
            entries += [_entry(e, mix=True) for e in _list(data, MIX_N_MATCH_KEY)]
            if base is None:
                base = next((e.intermediate_size << e.tier for e in entries
                             if not e.is_mix and e.intermediate_size is not None), None)
            for e in entries:
                if e.intermediate_size is None and base is not None:
                    e.intermediate_size = base >> (e.tier[0] if e.is_mix else e.tier)
            sha256 = data.get("sha256", {})
            if not isinstance(sha256, dict):
                raise TypeError("'sha256' must map paths to hex digests")
            return cls(
                base_intermediate_size=base,
                common_files=[str(f) for f in _list(data, "common_files")],
                tiers=entries,
                sha256={str(k): str(v) for k, v in sha256.items()},
            )
        except (KeyError, TypeError, ValueError) as err:
            raise ManifestError(
                f"{source} is malformed ({type(err).__name__}: {err}); re-export the tiers."
            ) from err


def _list(data: dict[str, Any], key: str) -> list[Any]:
    value = data.get(key, [])
    if not isinstance(value, list):
        raise TypeError(f"{key!r} must be a list, got {type(value).__name__}")
    return value


def _count(value: Any, what: str) -> int:
    """A non-negative JSON integer (True and 2.5 are not)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{what} must be a non-negative integer, got {value!r}")
    return value


def _entry(data: Any, *, mix: bool) -> TierEntry:
    if not isinstance(data, dict):
        raise TypeError(f"a tier entry must be an object, got {data!r}")
    if mix:
        tier: int | tuple[int, ...] = tuple(
            _count(t, "a layer tier") for t in data["layer_tiers"])
        if not tier:
            raise ValueError("a Mix'n'Match entry has an empty 'layer_tiers'")
    elif isinstance(data.get("tier"), str) and "layer_tiers" in data:
        # written by Matformer before Mix'n'Match entries moved to their own key
        return _entry(data, mix=True)
    else:
        tier = _count(data["tier"], "tier")
    width = data.get("intermediate_size")
    files = data.get("files", [])
    if not isinstance(files, list):
        raise TypeError(f"'files' of tier {tier} must be a list")
    return TierEntry(tier=tier, intermediate_size=None if width is None else _count(
        width, "intermediate_size"), files=[str(f) for f in files])


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def weights_digest(sha256: dict[str, str]) -> str:
    """One digest of a checkpoint's weights from each weights file's sha256 (by name: the
    index and its shards, or ``model.safetensors``): what a tier slice records of its source."""
    lines = "".join(f"{name} {sha256[name]}\n" for name in sorted(sha256))
    return hashlib.sha256(lines.encode()).hexdigest()


def slice_folder(tier: Tier) -> str:
    """The folder of a slice inside its universal checkpoint: ``tier2``, or for a
    Mix'n'Match list ``mix-0-0-1-2``."""
    if isinstance(tier, int):
        return f"tier{tier}"
    return "mix-" + "-".join(map(str, tier))


def beside_folder(name: str, tier: Tier) -> str:
    """Where psyche-elastic (and Matformer before slices moved inside) puts the slice of the
    universal folder ``name``: ``name-tier2`` beside it, or ``name-mix-0-0-1-2``."""
    return f"{name}-{slice_folder(tier)}"


def is_slice_folder(path: Path) -> bool:
    return path.is_dir() and re.fullmatch(r"tier\d+|mix(-\d+)+", path.name) is not None
