"""Export tier slices of a universal checkpoint, and the manifest that lists them.

Each tier ``t`` becomes the folder ``tier<t>/`` inside the source (``mix-0-0-1-2/`` for a
Mix'n'Match list): a complete checkpoint (config, weights sharded like the source, common
files) that plain ``transformers`` can open, so one folder holds a model and all its slices
(``rm -r`` takes them together). Every slice is staged first and renamed into place only once
all of them were written; the manifest, in the source folder, is written last, and slices of
an earlier export that this one did not write again are removed after it.

Each slice's ``config.json`` records the digest of the weights it was cut from
(``matformer_source_sha256``), so a loader can tell a slice of these very weights from one
of a model that has since been trained further or replaced.

Common files are what a tier needs besides its config and weights: the tokenizer's files and
``generation_config.json`` (in the source's top folder) and custom code (``*.py``, in any
folder but another checkpoint's). Any other file of the top folder (metrics, READMEs) stays
out of the slices, which every client of the tier downloads, and the export says which it
left out; subfolders holding checkpoints or logs (a run's ``checkpoints/``) are not looked at.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path

from matformer.modeling.atomic import built_aside, write_json_atomic
from matformer.modeling.checkpoint.files import (
    CONFIG_NAME,
    copy_files,
    read_json,
    read_weights,
    shard_bytes,
    weight_files,
    write_json,
    write_weights,
)
from matformer.modeling.checkpoint.hf_config import SOURCE_KEY, is_llama_shaped, to_config_dict
from matformer.modeling.checkpoint.manifest import (
    MANIFEST_NAME,
    Manifest,
    TierEntry,
    is_slice_folder,
    sha256_of,
    slice_folder,
    weights_digest,
)
from matformer.modeling.checkpoint.pretrained import read_config
from matformer.modeling.checkpoint.remote_code import listed_modules, pack_code
from matformer.modeling.checkpoint.slicing import slice_state
from matformer.modeling.errors import AlreadySliced, TierError
from matformer.modeling.matformer import layer_widths

log = logging.getLogger("matformer.checkpoint")


COMMON_NAMES = frozenset({
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "chat_template.jinja",
    "chat_template.json", "generation_config.json",
})


def common_files(source: Path) -> tuple[list[str], list[str]]:
    """(files every tier shares, files left out of the slices) among the source's extras.

    Extras are the files besides config, weights and manifest; hidden files and folders are
    neither shared nor reported.
    """
    own = {CONFIG_NAME, MANIFEST_NAME, *weight_files(source)}
    shared, left_out = [], []
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source)
        name = relative.as_posix()
        if not path.is_file() or name in own or any(p.startswith(".") for p in relative.parts):
            continue
        if len(relative.parts) == 1:
            (shared if name in COMMON_NAMES or name.endswith(".py") else left_out).append(name)
        elif name.endswith(".py") and not _in_checkpoint(source, relative):
            shared.append(name)  # code may sit in a package
    return shared, left_out


def _in_checkpoint(source: Path, relative: Path) -> bool:
    """Whether a subfolder on the way to ``relative`` is a checkpoint of its own (a slice,
    a run's ``checkpoints/step-N``), whose files are none of the source's."""
    folder = source
    for part in relative.parts[:-1]:
        folder = folder / part
        if (folder / CONFIG_NAME).is_file():
            return True
    return False


def export_tiers(
    source: str | Path, tiers: Sequence[int], mix_n_match: Sequence[Sequence[int]] = (),
    *, slice_writer: Callable[[Path, list[int]], list[str]] | None = None,
) -> Manifest:
    """Write ``source/tier<t>/`` for every tier, ``source/mix-0-0-1-2/`` for every
    Mix'n'Match list of per-layer tiers, and ``source/matformer_manifest.json``.
    ``slice_writer(folder, widths)`` writes a slice's weights into ``folder`` and returns
    their files (index first when sharded) in place of reading the source's weights here:
    the shards of a coordinator's close write their parts of each slice so."""
    source = Path(source).resolve()
    config = read_config(source)
    if config.matformer_tier != 0:
        raise AlreadySliced(
            f"{source} is already the tier {config.matformer_tier} slice of a "
            f"{config.matformer_base_intermediate_size}-wide model; export from the universal "
            "checkpoint instead (slicing a slice would cut the wrong neurons)."
        )
    # each slice: its tier (int, or tuple of per-layer tiers) → (layer tiers, layer widths)
    slices: dict[int | tuple[int, ...], tuple[list[int], list[int]]] = {}
    for tier in sorted(set(tiers)):
        if tier < 1:
            raise TierError(f"tier {tier}: export tiers >= 1; tier 0 is {source} itself.")
        slices[tier] = ([tier] * config.num_hidden_layers, layer_widths(config, tier))
    for layer_tiers in mix_n_match:
        layer_tiers = list(layer_tiers)
        slices[tuple(layer_tiers)] = (layer_tiers, layer_widths(config, layer_tiers))

    weights = weight_files(source)
    if slice_writer is None:
        shard_size, state = shard_bytes(source), read_weights(source)

        def slice_writer(folder: Path, widths: list[int]) -> list[str]:
            return write_weights(slice_state(state, widths), folder, shard_size)
    common, left_out = common_files(source)
    if left_out:
        log.warning("left out of the tier slices of %s (not tokenizer, generation config or "
                    "custom code): %s", source, ", ".join(left_out))
    manifest = Manifest(base_intermediate_size=config.matformer_base_intermediate_size,
                        common_files=common)
    manifest.tiers.append(TierEntry(tier=0, intermediate_size=config.intermediate_size,
                                    files=[CONFIG_NAME, *weights]))
    for name in [CONFIG_NAME, *weights, *common]:
        manifest.sha256[name] = sha256_of(source / name)
    digest = weights_digest({name: manifest.sha256[name] for name in weights})
    earlier = [path for path in source.iterdir() if is_slice_folder(path)]

    with ExitStack() as stack:
        for tier, (layer_tiers, widths) in slices.items():
            target = source / slice_folder(tier)
            staging = stack.enter_context(built_aside(target))
            staging.mkdir()
            tier_config = dataclasses.replace(
                config, intermediate_size=widths[0], matformer_tier=layer_tiers[0],
                matformer_layer_tiers=layer_tiers if isinstance(tier, tuple) else None,
            )
            copy_files(common, source, staging)
            code = None if is_llama_shaped(tier_config) else pack_code(
                tier_config, listed_modules(tier_config), staging)
            write_json(staging / CONFIG_NAME,
                       {**to_config_dict(tier_config, code), SOURCE_KEY: digest})
            files = slice_writer(staging, list(widths))
            listed = [CONFIG_NAME, *files]
            relative = [f"{target.name}/{name}" for name in listed]
            manifest.tiers.append(TierEntry(tier=tier, intermediate_size=widths[0],
                                            files=relative))
            for name, path in zip(listed, relative, strict=True):
                manifest.sha256[path] = sha256_of(staging / name)
    write_json_atomic(source / MANIFEST_NAME, manifest.to_dict())
    for path in earlier:
        if path.name not in {slice_folder(tier) for tier in slices}:
            shutil.rmtree(path)
    return manifest


def read_manifest(directory: Path) -> Manifest | None:
    path = Path(directory) / MANIFEST_NAME
    return Manifest.from_dict(read_json(path), str(path)) if path.is_file() else None
