"""Resolve which files a client loads for its tier, verify them, and build the model.

Strategies (seed 001):

- ``auto``: the tier slice when one is found complete, else the universal checkpoint, sliced
  at load (the reason says why the slice was not used);
- ``sliced``: the tier slice, or an error naming what is missing;
- ``universal``: the full checkpoint, always.

Where a slice is found: the entry for the tier in ``matformer_manifest.json`` (its own list
of files, for integer tiers and Mix'n'Match lists alike); without a manifest, the folder
``<name>-tier<t>/`` (or ``<name>-mix-0-0-1-2/``) beside the universal folder ``<name>/``, as
``matformer-export-tiers`` and psyche-elastic lay slices out, even when ``<name>/`` itself is
absent. A sibling has no hashes to check, so it is used only when its config declares the
tier asked for and describes the same model as the universal checkpoint (canonical schema).

What is loaded is exactly the files the manifest lists, never whatever else lies in their
folder: an entry must list a ``config.json`` and the weights (``model.safetensors``, or the
index and every shard it names), and every file the manifest lists a sha256 for is checked
before use, under every strategy. A checkpoint that is already a slice is never sliced again:
tiers are absolute, so it loads as it is, and ``universal`` refuses it.
"""

from __future__ import annotations

import dataclasses
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from modeling.checkpoint.export import slice_folder
from modeling.checkpoint.files import (
    CONFIG_NAME,
    INDEX_NAME,
    WEIGHTS_NAME,
    is_weights_file,
    read_json,
    read_weights,
)
from modeling.checkpoint.hf_config import from_config_dict
from modeling.checkpoint.manifest import MANIFEST_NAME, Manifest, sha256_of
from modeling.checkpoint.pretrained import load_state_into
from modeling.checkpoint.repository import HubRepository, LocalRepository, normalize
from modeling.checkpoint.schema import canonical_schema_hash
from modeling.checkpoint.slicing import slice_state
from modeling.config import ModelConfig
from modeling.errors import (
    AlreadySliced,
    CheckpointError,
    ConfigError,
    IncompleteTier,
    IntegrityError,
    ManifestMissing,
    MatformerError,
    SliceMismatch,
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
    weights: list[str]  # the weights files in ``directory`` that load reads, index first
    files: list[str]  # repository-relative paths fetched
    manifest: Manifest | None
    reason: str  # one line, for logs


class _Unusable(Exception):
    """Why a slice cannot be used; ``sliced`` raises ``error``, ``auto`` falls back."""

    def __init__(self, why: str, error: MatformerError) -> None:
        super().__init__(why)
        self.why = why
        self.error = error


def _wants_slice(tier: Tier) -> bool:
    return tier != 0 if isinstance(tier, int) else any(t > 0 for t in tier)


def _open(source: str | Path, tier: Tier, revision: str | None, cache_dir: Path | None
          ) -> tuple[Any, str]:
    """(repository, folder of the checkpoint inside it)."""
    path = Path(source).expanduser()
    sibling = path.parent / slice_folder(path.name, tier) if _wants_slice(tier) else None
    if path.is_dir() or (sibling is not None and path.name and sibling.is_dir()):
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


@dataclass(slots=True)
class _Files:
    """A checkpoint's files, as repository paths: its config.json and its weights."""

    config: str
    weights: list[str]  # model.safetensors, or the index then its shards

    @property
    def paths(self) -> list[str]:
        return [self.config, *self.weights]


def _listed(paths: list[str], what: str) -> _Files:
    """The config and weights among the paths a manifest entry lists for ``what``."""
    configs = [p for p in paths if posixpath.basename(p) == CONFIG_NAME]
    weights = sorted((p for p in paths if is_weights_file(p)),
                     key=lambda p: (posixpath.basename(p) != INDEX_NAME, p))
    gaps = []
    if len(configs) != 1:
        gaps.append(f"{len(configs)} config.json files" if configs else "no config.json")
    names = [posixpath.basename(w) for w in weights]
    if not weights:
        gaps.append(f"no weights ({WEIGHTS_NAME} or {INDEX_NAME})")
    elif INDEX_NAME not in names and names != [WEIGHTS_NAME]:
        gaps.append(f"shards without their {INDEX_NAME}")
    elif configs and any(posixpath.dirname(w) != posixpath.dirname(configs[0])
                         for w in weights):
        gaps.append("weights outside its config.json's folder")
    if gaps:
        why = f"the manifest's entry for {what} lists {' and '.join(gaps)}"
        raise _Unusable(why, IncompleteTier(f"{why}; re-export the tiers."))
    return _Files(configs[0], weights)


def _folder_files(repository: Any, folder: str, fetcher: _Fetcher) -> _Files | None:
    """A folder's checkpoint as Hugging Face lays it out (no manifest to say which files);
    None when it has no config.json."""
    config = posixpath.join(folder, CONFIG_NAME)
    if repository.fetch(config) is None:
        return None
    index = fetcher.one(posixpath.join(folder, INDEX_NAME))
    if index is None:
        return _Files(config, [posixpath.join(folder, WEIGHTS_NAME)])
    shards = sorted(set(read_json(index).get("weight_map", {}).values()))
    return _Files(config, [posixpath.join(folder, n) for n in (INDEX_NAME, *shards)])


def _fetch(files: _Files, common: list[str], fetcher: _Fetcher, what: str
           ) -> dict[str, Path]:
    """Fetch and verify ``files`` and ``common``; every shard the index names must be among
    the listed weights."""
    found, missing = fetcher.all(files.paths + common)
    if missing:
        raise _Unusable(f"missing {', '.join(missing)}", IncompleteTier(
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
            raise _Unusable(why, IncompleteTier(f"{what}: {why}; re-export the tiers."))
    return found


def _manifest_slice(source: str | Path, tier: Tier, manifest: Manifest, folder: str
                    ) -> _Files:
    label = tier_label(tier)
    entry = manifest.entry(tier)
    if entry is None:
        why = f"{MANIFEST_NAME} lists no tier {label}"
        raise _Unusable(why, TierNotInManifest(
            f"{MANIFEST_NAME} of {source} lists no tier {label}; available tiers: "
            f"{', '.join(manifest.available_tiers())}."))
    return _listed([normalize(f, folder) for f in entry.files], f"tier {label}")


def _sibling_slice(source: str | Path, tier: Tier, repository: Any, folder: str,
                   fetcher: _Fetcher) -> _Files:
    name = posixpath.basename(folder)
    sibling = posixpath.join(posixpath.dirname(folder), slice_folder(name, tier)) if name else ""
    files = _folder_files(repository, sibling, fetcher) if sibling else None
    if files is None:
        where = f" and no slice folder {sibling}/" if sibling else ""
        why = f"no {MANIFEST_NAME}{where}"
        raise _Unusable(why, ManifestMissing(
            f"{source} has no {MANIFEST_NAME}{where}, so no tier {tier_label(tier)} slice is "
            "known; export the slices with matformer-export-tiers or use --load-strategy "
            "auto/universal."))
    return files


def _check_sibling(config: ModelConfig, tier: Tier, universal: ModelConfig | None,
                   where: str) -> None:
    """A slice found by its folder name must declare ``tier`` and be the universal's model."""
    wanted = [tier] * config.num_hidden_layers if isinstance(tier, int) else list(tier)
    if config.stored_tiers() != wanted:
        why = f"{where} holds tier {_label(config.stored_tiers())}, not {_label(wanted)}"
        raise _Unusable(why, SliceMismatch(f"{why}; re-export the tiers."))
    if universal is not None and (canonical_schema_hash(config, ())
                                  != canonical_schema_hash(universal, ())):
        why = f"{where} describes another model than the universal checkpoint"
        raise _Unusable(why, SliceMismatch(
            f"{why} (its config.json differs beyond the FFN width); re-export the tiers."))


def _label(tiers: list[int]) -> str:
    """"2" for a slice of one tier, "mix:0,1" for a Mix'n'Match slice."""
    return tier_label(tiers[0] if len(set(tiers)) == 1 else tiers)


def _stored_label(own: dict[str, Any]) -> str | None:
    """The tier label of a config.json that is a slice, None for a universal one."""
    try:
        stored = from_config_dict(own).stored_tiers()
    except MatformerError:
        return None  # judged again, with its error, when the files are loaded
    return _label(stored) if any(stored) else None


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
        repository, folder = _open(source, tier, revision, cache_dir)
    else:
        folder = str(source)
    manifest_path = repository.fetch(posixpath.join(folder, MANIFEST_NAME))
    manifest = None
    if manifest_path is not None:
        manifest = Manifest.from_dict(read_json(manifest_path), f"{source}/{MANIFEST_NAME}")
    common = [normalize(f, folder) for f in manifest.common_files] if manifest else []
    fetcher = _Fetcher(repository, manifest, folder)
    own_path = fetcher.one(posixpath.join(folder, CONFIG_NAME))
    own = read_json(own_path) if own_path is not None else None
    base = manifest.base_intermediate_size if manifest else None
    label = tier_label(tier)

    own_slice = _stored_label(own) if own is not None else None
    hint: int | None = None  # the tier the manifest says the loaded files hold
    if own_slice is not None:
        if strategy == "universal":
            raise AlreadySliced(
                f"{source} is the tier {own_slice} slice, not a universal checkpoint; point "
                "at the universal checkpoint for 'universal', or use 'auto'/'sliced' to load "
                "this slice as it is."
            )
        used, reason = "sliced", f"the source is already the tier {own_slice} slice"
        files = _folder_files(repository, folder, fetcher)
        try:
            found = _fetch(files, common, fetcher, str(source))
        except _Unusable as unusable:
            raise CheckpointError(f"{source}: {unusable.why}.") from None
    elif not _wants_slice(tier) or strategy == "universal":
        used = "universal"
        reason = "universal requested" if _wants_slice(tier) else "tier 0 is the universal"
    else:
        universal = from_config_dict(own, base=base) if own is not None else None
        try:
            if manifest is not None:
                files = _manifest_slice(source, tier, manifest, folder)
                if isinstance(tier, int):
                    hint = tier
                found = _fetch(files, common, fetcher, f"tier {label} of {source}")
                used, reason = "sliced", f"tier {label} slice listed in the manifest"
            else:
                files = _sibling_slice(source, tier, repository, folder, fetcher)
                found = _fetch(files, common, fetcher, f"tier {label} of {source}")
                where = posixpath.dirname(files.config)
                base = universal.intermediate_size if universal is not None else None
                _check_sibling(from_config_dict(read_json(found[files.config]), base=base),
                               tier, universal, where)
                used = "sliced"
                reason = f"tier {label} slice in the sibling folder {where}/ (no manifest)"
                if universal is None:
                    reason += f"; unchecked against a universal checkpoint, {source} is absent"
        except _Unusable as unusable:
            if strategy == "sliced" or own is None:
                raise unusable.error from None
            used, hint = "universal", None
            reason = f"tier {label} slice unusable ({unusable.why}); slicing at load"
    if used == "universal":
        files = _universal_files(source, repository, folder, manifest, fetcher)
        try:
            found = _fetch(files, common, fetcher, str(source))
        except _Unusable as unusable:
            raise CheckpointError(f"{source}: {unusable.why}.") from None

    directory = found[files.config].parent
    config = from_config_dict(read_json(found[files.config]), tier=hint, base=base)
    return ResolvedCheckpoint(
        source=str(source), tier=tier, strategy=strategy, used=used, config=config,
        directory=directory, weights=[posixpath.relpath(w, posixpath.dirname(files.config))
                                      for w in files.weights],
        files=list(found), manifest=manifest, reason=reason,
    )


def _universal_files(source: str | Path, repository: Any, folder: str,
                     manifest: Manifest | None, fetcher: _Fetcher) -> _Files:
    if manifest is not None and manifest.entry(0) is not None:
        try:
            return _listed([normalize(f, folder) for f in manifest.entry(0).files], "tier 0")
        except _Unusable as unusable:
            raise unusable.error from None
    files = _folder_files(repository, folder, fetcher)
    if files is None:
        raise CheckpointError(f"{source} has no {CONFIG_NAME}: it is not a checkpoint folder.")
    return files


def load(resolved: ResolvedCheckpoint) -> nn.Module:
    """Build and fill the model of a resolved checkpoint, from the verified files only.

    A universal checkpoint loaded by ``auto`` for tier t > 0 is sliced to tier t here, so
    the client holds only its tier's weights; under ``universal`` it stays whole.
    """
    config = resolved.config
    state = read_weights(resolved.directory, resolved.weights)
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
