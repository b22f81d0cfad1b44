"""Resolve which files a client loads for its tier, verify them, and build the model.

Strategies (seed 001):

- ``auto``: the tier slice when the manifest lists it and every file is there, else the
  universal checkpoint, sliced at load;
- ``sliced``: the tier slice or an error naming what is missing;
- ``universal``: the full checkpoint, always.

Every file the manifest lists a sha256 for is checked before use, under every strategy. A
checkpoint that is already a slice is never sliced again: tiers are absolute (DESIGN.md §4),
so it loads as it is, and ``universal`` refuses it.
"""

from __future__ import annotations

import dataclasses
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from modeling.checkpoint.files import CONFIG_NAME, INDEX_NAME, WEIGHTS_NAME, read_json, read_weights
from modeling.checkpoint.hf_config import from_config_dict
from modeling.checkpoint.manifest import MANIFEST_NAME, Manifest, TierEntry, sha256_of
from modeling.checkpoint.pretrained import load_state_into
from modeling.checkpoint.repository import HubRepository, LocalRepository, normalize
from modeling.checkpoint.slicing import slice_state
from modeling.config import ModelConfig
from modeling.errors import (
    AlreadySliced,
    CheckpointError,
    ConfigError,
    IncompleteTier,
    IntegrityError,
    ManifestMissing,
    TierNotInManifest,
)
from modeling.matformer import Tier, layer_widths, tier_label
from modeling.models import build_model

STRATEGIES = ("auto", "sliced", "universal")


@dataclass(slots=True)
class ResolvedCheckpoint:
    """What ``resolve`` decided, and the verified local files to load."""

    source: str
    tier: Tier  # the tier (or Mix'n'Match list) the caller will train
    strategy: str  # the strategy asked for
    used: str  # "sliced" or "universal": what is actually loaded
    config: ModelConfig  # of the files loaded, metadata filled in
    directory: Path  # local folder holding the loaded config.json and weights
    files: list[str]  # repository-relative paths fetched
    manifest: Manifest | None
    reason: str  # one line, for logs


def _open(source: str | Path, revision: str | None, cache_dir: Path | None
          ) -> tuple[Any, str]:
    """(repository, folder of the checkpoint inside it)."""
    path = Path(source).expanduser()
    if path.is_dir():
        path = path.resolve()
        # siblings (../name-tier1) must be reachable, so the root is the parent folder
        return LocalRepository(path.parent), path.name
    if isinstance(source, str) and source.count("/") == 1 and not path.exists():
        return HubRepository(source, revision, cache_dir), ""
    raise CheckpointError(
        f"{source!r} is neither a checkpoint folder nor a hub repo id ('org/name')."
    )


class _Fetcher:
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


def _universal_files(repository: Any, folder: str, manifest: Manifest | None) -> list[str]:
    if manifest is not None and manifest.entry(0) is not None:
        return [normalize(f, folder) for f in manifest.entry(0).files]
    index = repository.fetch(posixpath.join(folder, INDEX_NAME))
    if index is None:
        return [posixpath.join(folder, CONFIG_NAME), posixpath.join(folder, WEIGHTS_NAME)]
    shards = sorted(set(read_json(index).get("weight_map", {}).values()))
    return [posixpath.join(folder, name) for name in (CONFIG_NAME, INDEX_NAME, *shards)]


def infer_metadata(data: dict[str, Any], *, tier: int | None, base: int | None
                   ) -> dict[str, Any]:
    """Fill in ``matformer_tier`` and ``matformer_base_intermediate_size`` when missing."""
    data = dict(data)
    width = data.get("intermediate_size")
    if "matformer_tier" not in data:
        if tier is None and base and width and base != width:
            ratio = base // width
            if base % width or ratio & (ratio - 1):
                raise ConfigError(
                    f"intermediate_size {width} is not base {base} / 2**t for any tier t; "
                    "set matformer_tier in config.json."
                )
            tier = ratio.bit_length() - 1
        data["matformer_tier"] = tier or 0
    if "matformer_base_intermediate_size" not in data and base is not None:
        data["matformer_base_intermediate_size"] = base
    return data


@dataclass(slots=True)
class _Choice:
    used: str  # "sliced" or "universal"
    reason: str
    paths: list[str]  # repository paths of config + weights to fetch
    entry: TierEntry | None  # the manifest entry used for a slice, for metadata


def _choose(source: str | Path, tier: Tier, strategy: str, own: dict[str, Any],
            manifest: Manifest | None, repository: Any, folder: str) -> _Choice:
    """Which files to try first, before anything but the manifest and config is fetched."""
    label = tier_label(tier)
    own_tiers = own.get("matformer_layer_tiers") or int(own.get("matformer_tier", 0))
    own_sliced = any(own_tiers) if isinstance(own_tiers, list) else own_tiers > 0
    if own_sliced:
        own_label = tier_label(own_tiers)
        if strategy == "universal":
            raise AlreadySliced(
                f"{source} is the tier {own_label} slice, not a universal checkpoint; point "
                "at the universal checkpoint for 'universal', or use 'auto'/'sliced' to load "
                "this slice as it is."
            )
        return _Choice("sliced", f"the source is already the tier {own_label} slice",
                       _universal_files(repository, folder, None), None)
    wants_slice = tier != 0 if isinstance(tier, int) else any(t > 0 for t in tier)
    if not wants_slice or strategy == "universal":
        reason = "universal requested" if wants_slice else "tier 0 is the universal checkpoint"
        return _Choice("universal", reason, [], None)
    entry = manifest.entry(tier) if manifest else None
    if strategy == "sliced" and manifest is None:
        raise ManifestMissing(
            f"{source} has no {MANIFEST_NAME}, so no tier slices are known; export them "
            "with matformer-export-tiers or use --load-strategy auto/universal."
        )
    if strategy == "sliced" and entry is None:
        raise TierNotInManifest(
            f"{MANIFEST_NAME} of {source} lists no tier {label}; available tiers: "
            f"{', '.join(manifest.available_tiers())}."
        )
    paths = [normalize(f, folder) for f in entry.files] if entry else []
    return _Choice("sliced", f"tier {label} slice listed in the manifest", paths, entry)


def resolve(
    source: str | Path,
    tier: Tier = 0,
    strategy: str = "auto",
    *,
    revision: str | None = None,
    cache_dir: Path | None = None,
    repository: Any | None = None,
) -> ResolvedCheckpoint:
    """Pick, fetch and verify the files for ``tier`` from a folder or hub repo id; or, with
    ``repository`` (any object with ``fetch(path) -> Path | None``), from its folder
    ``source``: a coordinator's checkpoints fetched over gRPC, say."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"load strategy {strategy!r} is not one of {', '.join(STRATEGIES)}.")
    if repository is None:
        repository, folder = _open(source, revision, cache_dir)
    else:
        folder = str(source)
    manifest_path = repository.fetch(posixpath.join(folder, MANIFEST_NAME))
    manifest = None
    if manifest_path is not None:
        manifest = Manifest.from_dict(read_json(manifest_path), f"{source}/{MANIFEST_NAME}")
    common = [normalize(f, folder) for f in manifest.common_files] if manifest else []
    fetcher = _Fetcher(repository, manifest, folder)
    own_config = fetcher.one(posixpath.join(folder, CONFIG_NAME))
    own = read_json(own_config) if own_config else {}

    choice = _choose(source, tier, strategy, own, manifest, repository, folder)
    found: dict[str, Path] = {}
    if choice.used == "sliced":
        found, missing = fetcher.all(choice.paths + common)
        if missing and strategy == "sliced":
            raise IncompleteTier(
                f"tier {tier_label(tier)} of {source} is incomplete; missing: "
                f"{', '.join(missing)}. Fetch or re-export them, or use --load-strategy auto."
            )
        if missing or not choice.paths:
            why = f"missing {', '.join(missing)}" if missing else "not in a manifest"
            reason = f"tier {tier_label(tier)} slice unusable ({why}); slicing at load"
            choice = _Choice("universal", reason, [], None)
    if choice.used == "universal":
        choice.paths = _universal_files(repository, folder, manifest)
        found, missing = fetcher.all(choice.paths + common)
        if missing:
            raise CheckpointError(f"{source} is missing {', '.join(missing)}.")

    config_path = found[next(p for p in choice.paths if p.endswith(CONFIG_NAME))]
    entry_tier = choice.entry.tier if choice.entry and choice.entry.layer_tiers is None else None
    base = manifest.base_intermediate_size if manifest else None
    data = infer_metadata(read_json(config_path), tier=entry_tier, base=base)
    return ResolvedCheckpoint(
        source=str(source), tier=tier, strategy=strategy, used=choice.used,
        config=from_config_dict(data), directory=config_path.parent, files=list(found),
        manifest=manifest, reason=choice.reason,
    )


def load(resolved: ResolvedCheckpoint) -> nn.Module:
    """Build and fill the model of a resolved checkpoint.

    A universal checkpoint loaded by ``auto`` for tier t > 0 is sliced to tier t here, so
    the client holds only its tier's weights; under ``universal`` it stays whole.
    """
    config = resolved.config
    state = read_weights(resolved.directory)
    tier = resolved.tier
    tiers = [tier] * config.num_hidden_layers if isinstance(tier, int) else list(tier)
    if resolved.used == "universal" and resolved.strategy == "auto" and any(tiers):
        widths = layer_widths(config, tier)
        config = dataclasses.replace(
            config, intermediate_size=widths[0], matformer_tier=tiers[0],
            matformer_layer_tiers=None if isinstance(tier, int) else tiers,
        )
        state = slice_state(state, widths)
    model = build_model(config)
    load_state_into(model, state, resolved.directory)
    return model


def load_for_tier(source: str | Path, tier: Tier = 0, strategy: str = "auto",
                  **kwargs: Any) -> tuple[nn.Module, ResolvedCheckpoint]:
    """``resolve`` then ``load``: the model for ``tier`` and how it was found."""
    resolved = resolve(source, tier, strategy, **kwargs)
    return load(resolved), resolved
