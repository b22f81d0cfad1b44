"""Resolve which files a client loads for its tier, verify them, and build the model.

Strategies (seed 001):

- ``auto``: the tier slice when one is found complete, else the universal checkpoint, sliced
  at load (the reason says why the slice was not used);
- ``sliced``: the tier slice, or an error naming what is missing;
- ``universal``: the full checkpoint, always.

Where a slice is found: the entry for the tier in ``matformer_manifest.json`` (its own list
of files, for integer tiers and Mix'n'Match lists alike); without a manifest, the folder
``tier<t>/`` (or ``mix-0-0-1-2/``) inside the universal folder ``<name>/``, as
``matformer-export-tiers`` lays slices out, else ``<name>-tier<t>/`` beside it, as
psyche-elastic does, even when ``<name>/`` itself is absent. Such a folder has no hashes to
check, so it is used only when its config declares the tier asked for and describes the same
model as the universal checkpoint (canonical schema).

A slice is used only if it was cut from these very weights: its config records the digest
of the weights it was cut from, and where the universal checkpoint's weights are on this
machine they are hashed and compared (a model trained further since its export has stale
slices; ``auto`` then slices the universal at load instead, and says so).

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

from matformer.modeling.checkpoint.files import CONFIG_NAME, read_json, read_weights
from matformer.modeling.checkpoint.hf_config import SOURCE_KEY, from_config_dict
from matformer.modeling.checkpoint.listing import (
    Fetcher,
    ListedFiles,
    Unusable,
    fetch_listed,
    in_folder,
    listed,
)
from matformer.modeling.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    beside_folder,
    sha256_of,
    slice_folder,
    weights_digest,
)
from matformer.modeling.checkpoint.pretrained import model_from_state
from matformer.modeling.checkpoint.remote_code import consented, packed_modules
from matformer.modeling.checkpoint.repository import (
    HubRepository,
    LocalRepository,
    is_repo_id,
    normalize,
)
from matformer.modeling.checkpoint.schema import canonical_schema_hash
from matformer.modeling.checkpoint.slicing import slice_state
from matformer.modeling.config import ModelConfig
from matformer.modeling.errors import (
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
from matformer.modeling.matformer import Tier, layer_widths, tier_label

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


@dataclass(slots=True)
class _Source:
    """The checkpoint folder asked for: where it lives, its manifest and its own config."""

    name: str  # as the caller gave it, for messages
    repository: Any  # anything with fetch(path) -> Path | None
    folder: str  # the checkpoint's folder inside the repository
    manifest: Manifest | None
    fetcher: Fetcher
    common: list[str]  # repository paths of the manifest's common files
    own: dict[str, Any] | None  # its config.json; None when the folder has none (or is gone)


@dataclass(slots=True)
class _Choice:
    used: str  # "sliced" or "universal"
    reason: str
    files: ListedFiles
    found: dict[str, Path]  # repository path → verified local file
    tier: int | None = None  # the tier the manifest says these files hold
    base: int | None = None  # the base FFN width, where the config may lack it


def _wants_slice(tier: Tier) -> bool:
    return tier != 0 if isinstance(tier, int) else any(t > 0 for t in tier)


def _open(source: str | Path, tier: Tier, revision: str | None, cache_dir: Path | None
          ) -> tuple[Any, str]:
    """(repository, folder of the checkpoint inside it)."""
    path = Path(source).expanduser()
    sibling = path.parent / beside_folder(path.name, tier) if _wants_slice(tier) else None
    if path.is_dir() or (sibling is not None and path.name and sibling.is_dir()):
        path = path.resolve()
        # siblings (../name-tier1) must be reachable, so the root is the parent folder
        return LocalRepository(path.parent), path.name
    if isinstance(source, str) and is_repo_id(source):
        return HubRepository(source, revision, cache_dir), ""
    raise CheckpointError(
        f"{source!r} is neither a checkpoint folder nor a hub repo id ('org/name')."
    )


def _read_source(source: str | Path, repository: Any, folder: str) -> _Source:
    manifest_path = repository.fetch(posixpath.join(folder, MANIFEST_NAME))
    manifest = None
    if manifest_path is not None:
        manifest = Manifest.from_dict(read_json(manifest_path), f"{source}/{MANIFEST_NAME}")
    fetcher = Fetcher(repository, manifest, folder)
    own_path = fetcher.one(posixpath.join(folder, CONFIG_NAME))
    return _Source(
        name=str(source), repository=repository, folder=folder, manifest=manifest,
        fetcher=fetcher,
        common=[normalize(f, folder) for f in manifest.common_files] if manifest else [],
        own=read_json(own_path) if own_path is not None else None,
    )


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


def _manifest_slice(src: _Source, tier: Tier) -> _Choice:
    """The slice the manifest lists for ``tier``."""
    label = tier_label(tier)
    entry = src.manifest.entry(tier)
    if entry is None:
        why = f"{MANIFEST_NAME} lists no tier {label}"
        raise Unusable(why, TierNotInManifest(
            f"{MANIFEST_NAME} of {src.name} lists no tier {label}; available tiers: "
            f"{', '.join(src.manifest.available_tiers())}."))
    files = listed([normalize(f, src.folder) for f in entry.files], f"tier {label}")
    found = fetch_listed(files, src.common, src.fetcher, f"tier {label} of {src.name}")
    return _Choice("sliced", f"tier {label} slice listed in the manifest", files, found,
                   tier=tier if isinstance(tier, int) else None,
                   base=src.manifest.base_intermediate_size)


def _folder_slice(src: _Source, tier: Tier) -> _Choice:
    """The slice in ``tier<t>/`` inside the source, or ``<name>-tier<t>/`` beside it, without
    a manifest: used only when its config declares ``tier`` and describes the universal's
    model."""
    label = tier_label(tier)
    name = posixpath.basename(src.folder)
    inside = posixpath.join(src.folder, slice_folder(tier))
    beside = posixpath.join(posixpath.dirname(src.folder), beside_folder(name, tier))
    folder, files = inside, in_folder(inside, src.fetcher)
    if files is None and name:
        folder, files = beside, in_folder(beside, src.fetcher)
    if files is None:
        where = f" and no slice folder {inside}/" + (f" or {beside}/" if name else "")
        why = f"no {MANIFEST_NAME}{where}"
        raise Unusable(why, ManifestMissing(
            f"{src.name} has no {MANIFEST_NAME}{where}, so no tier {label} slice is known; "
            "export the slices with matformer-export-tiers or use --load-strategy "
            "auto/universal."))
    found = fetch_listed(files, src.common, src.fetcher, f"tier {label} of {src.name}")
    universal = from_config_dict(src.own) if src.own is not None else None
    base = universal.intermediate_size if universal is not None else None
    config = from_config_dict(read_json(found[files.config]), base=base)
    wanted = [tier] * config.num_hidden_layers if isinstance(tier, int) else list(tier)
    if config.stored_tiers() != wanted:
        why = f"{folder} holds tier {_label(config.stored_tiers())}, not {_label(wanted)}"
        raise Unusable(why, SliceMismatch(f"{why}; re-export the tiers."))
    if universal is not None and (canonical_schema_hash(config, ())
                                  != canonical_schema_hash(universal, ())):
        why = f"{folder} describes another model than the universal checkpoint"
        raise Unusable(why, SliceMismatch(
            f"{why} (its config.json differs beyond the FFN width); re-export the tiers."))
    reason = f"tier {label} slice in the folder {folder}/ (no manifest)"
    if universal is None:
        reason += f"; unchecked against a universal checkpoint, {src.name} is absent"
    return _Choice("sliced", reason, files, found, base=base)


def _check_source(src: _Source, choice: _Choice, label: str) -> None:
    """Raise Unusable when the slice records a source digest and the universal checkpoint's
    weights, on this machine, are others: the slice was cut from a model since replaced."""
    recorded = read_json(choice.found[choice.files.config]).get(SOURCE_KEY)
    if recorded is None or src.own is None or not isinstance(src.repository, LocalRepository):
        return  # exported elsewhere (psyche-elastic), or no local universal to compare with
    files = in_folder(src.folder, src.fetcher)
    local = {path: src.repository.fetch(path) for path in files.weights} if files else {}
    if not local or any(path is None for path in local.values()):
        return
    actual = weights_digest({posixpath.relpath(path, src.folder): sha256_of(found)
                             for path, found in local.items()})
    if actual != recorded:
        why = (f"the tier {label} slice was cut from other weights than {src.name}'s (the "
               "model was trained or replaced after its export)")
        raise Unusable(why, SliceMismatch(f"{why}; export the tiers again, or use "
                                          "--load-strategy auto to slice at load."))


def _universal(src: _Source, reason: str) -> _Choice:
    """The universal checkpoint: the manifest's tier 0 entry, else the folder's files."""
    entry = src.manifest.entry(0) if src.manifest is not None else None
    if entry is not None:
        try:
            files = listed([normalize(f, src.folder) for f in entry.files], "tier 0")
        except Unusable as unusable:
            raise unusable.error from None
    else:
        files = in_folder(src.folder, src.fetcher)
        if files is None:
            raise CheckpointError(f"{src.name} has no {CONFIG_NAME}: it is not a checkpoint "
                                  "folder.")
    try:
        found = fetch_listed(files, src.common, src.fetcher, src.name)
    except Unusable as unusable:
        raise CheckpointError(f"{src.name}: {unusable.why}.") from None
    base = src.manifest.base_intermediate_size if src.manifest else None
    return _Choice("universal", reason, files, found, base=base)


def _as_is(src: _Source, label: str) -> _Choice:
    """The source folder, which is itself a slice: loaded as it is, never sliced again."""
    files = in_folder(src.folder, src.fetcher)
    try:
        found = fetch_listed(files, src.common, src.fetcher, src.name)
    except Unusable as unusable:
        raise CheckpointError(f"{src.name}: {unusable.why}.") from None
    return _Choice("sliced", f"the source is already the tier {label} slice", files, found)


def resolve(
    source: str | Path,
    tier: Tier = 0,
    strategy: str = "auto",
    *,
    revision: str | None = None,
    cache_dir: Path | None = None,
    repository: Any | None = None,
    trust_remote_code: bool = False,
) -> ResolvedCheckpoint:
    """Pick, fetch and verify the files for ``tier`` from a folder or hub repo id; or, with
    ``repository`` (any object with ``fetch(path) -> Path | None``), from its folder
    ``source``: a coordinator's checkpoints fetched over gRPC, say. The checkpoint's own
    module files are kept for ``load`` to run only with ``trust_remote_code``."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"load strategy {strategy!r} is not one of {', '.join(STRATEGIES)}.")
    if repository is None:
        repository, folder = _open(source, tier, revision, cache_dir)
    else:
        folder = str(source)
    src = _read_source(source, repository, folder)
    own_slice = _stored_label(src.own) if src.own is not None else None
    if own_slice is not None:
        if strategy == "universal":
            raise AlreadySliced(
                f"{source} is the tier {own_slice} slice, not a universal checkpoint; point "
                "at the universal checkpoint for 'universal', or use 'auto'/'sliced' to load "
                "this slice as it is."
            )
        choice = _as_is(src, own_slice)
    elif not _wants_slice(tier):
        choice = _universal(src, "tier 0 is the universal")
    elif strategy == "universal":
        choice = _universal(src, "universal requested")
    else:
        try:
            choice = (_manifest_slice(src, tier) if src.manifest is not None
                      else _folder_slice(src, tier))
            _check_source(src, choice, tier_label(tier))
        except Unusable as unusable:
            if strategy == "sliced" or src.own is None:
                raise unusable.error from None
            choice = _universal(src, f"tier {tier_label(tier)} slice unusable "
                                     f"({unusable.why}); slicing at load")
    config_path = choice.found[choice.files.config]
    config = consented(packed_modules(from_config_dict(read_json(config_path), tier=choice.tier,
                                                       base=choice.base), config_path.parent),
                       trust_remote_code, source)
    if config.external_modules_path:  # allowed: run the copies the manifest vouches for
        config.external_modules_path = _module_files(src, choice.files.config,
                                                     config.external_modules_path)
    return ResolvedCheckpoint(
        source=str(source), tier=tier, strategy=strategy, used=choice.used, config=config,
        directory=config_path.parent, weights=choice.files.weight_names(),
        files=list(choice.found), manifest=src.manifest, reason=choice.reason,
    )


def _module_files(src: _Source, config_file: str, listed: list[str]) -> list[str]:
    """Local, verified copies of the module files a loaded config lists. With a manifest they
    are its common files of those names, each checked against its sha256 (a slice's config
    lists the code the universal carries); without one, the files beside the config."""
    names = [Path(path).name for path in listed]
    folder = src.folder if src.manifest is not None else posixpath.dirname(config_file)
    paths = [posixpath.join(folder, name) for name in names]
    unvouched = [p for p in paths if src.manifest is not None and p not in src.common]
    if unvouched:
        raise IntegrityError(
            f"{src.name}'s config lists module files its {MANIFEST_NAME} does not vouch for "
            f"({', '.join(unvouched)}); re-export the tiers, or do not run this checkpoint.")
    found, missing = src.fetcher.all(paths)
    if missing:
        raise IncompleteTier(f"{src.name} lacks the module files its config lists "
                             f"({', '.join(missing)}); copy them with the checkpoint.")
    return [str(found[p]) for p in paths]


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
    return model_from_state(config, state, resolved.directory)


def load_for_tier(source: str | Path, tier: Tier = 0, strategy: str = "auto",
                  **kwargs: Any) -> tuple[nn.Module, ResolvedCheckpoint]:
    """``resolve`` then ``load``: the model for ``tier`` and how it was found."""
    resolved = resolve(source, tier, strategy, **kwargs)
    return load(resolved), resolved
