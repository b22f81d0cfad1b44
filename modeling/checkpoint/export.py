"""Export tier slices of a universal checkpoint, and the manifest that lists them.

Each tier ``t`` becomes ``<name>-tier<t>/`` beside the source: a complete checkpoint (config,
weights sharded like the source, common files) that plain ``transformers`` can open. The
manifest goes in the source directory. Every tier directory is staged first and renamed
into place only once all of them were written; the manifest is written last.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from modeling.checkpoint.files import (
    CONFIG_NAME,
    INDEX_NAME,
    atomic_directory,
    copy_files,
    read_json,
    read_weights,
    weight_files,
    write_json,
    write_json_atomic,
    write_weights,
)
from modeling.checkpoint.hf_config import to_config_dict
from modeling.checkpoint.manifest import MANIFEST_NAME, Manifest, TierEntry, sha256_of
from modeling.checkpoint.pretrained import read_config
from modeling.checkpoint.slicing import slice_state
from modeling.errors import AlreadySliced, TierError
from modeling.matformer import layer_widths, tier_label


def common_files(source: Path, weights: Sequence[str]) -> list[str]:
    """Files a tier shares with the universal checkpoint: tokenizer files, custom code..."""
    skip = {CONFIG_NAME, MANIFEST_NAME, *weights}
    return sorted(
        path.relative_to(source).as_posix()
        for path in source.rglob("*")
        if path.is_file()
        and path.relative_to(source).as_posix() not in skip
        and not any(part.startswith(".") for part in path.relative_to(source).parts)
    )


def export_tiers(
    source: str | Path, tiers: Sequence[int], mix_n_match: Sequence[Sequence[int]] = ()
) -> Manifest:
    """Write ``<source>-tier<t>/`` for every tier, ``<source>-mix-0-0-1-2/`` for every
    Mix'n'Match list of per-layer tiers, and ``source/matformer_manifest.json``."""
    source = Path(source).resolve()
    config = read_config(source)
    if config.matformer_tier != 0:
        raise AlreadySliced(
            f"{source} is already the tier {config.matformer_tier} slice of a "
            f"{config.matformer_base_intermediate_size}-wide model; export from the universal "
            "checkpoint instead (slicing a slice would cut the wrong neurons)."
        )
    slices: dict[str, tuple[list[int], list[int]]] = {}  # dir suffix → (layer tiers, widths)
    for tier in sorted(set(tiers)):
        if tier < 1:
            raise TierError(f"tier {tier}: export tiers >= 1; tier 0 is {source} itself.")
        slices[f"tier{tier}"] = ([tier] * config.num_hidden_layers, layer_widths(config, tier))
    for layer_tiers in mix_n_match:
        layer_tiers = list(layer_tiers)
        name = "mix-" + "-".join(map(str, layer_tiers))
        slices[name] = (layer_tiers, layer_widths(config, layer_tiers))

    weights = weight_files(source)
    shard_bytes = None
    if weights[0] == INDEX_NAME:
        shard_bytes = max((source / f).stat().st_size for f in weights[1:])
    state = read_weights(source)
    common = common_files(source, weights)
    manifest = Manifest(base_intermediate_size=config.matformer_base_intermediate_size,
                        common_files=common)
    manifest.tiers.append(TierEntry(tier=0, intermediate_size=config.intermediate_size,
                                    files=[CONFIG_NAME, *weights]))
    for name in [CONFIG_NAME, *weights, *common]:
        manifest.sha256[name] = sha256_of(source / name)

    with ExitStack() as stack:
        for suffix, (layer_tiers, widths) in slices.items():
            target = source.parent / f"{source.name}-{suffix}"
            staging = stack.enter_context(atomic_directory(target))
            mixed = len(set(layer_tiers)) > 1 or suffix.startswith("mix")
            tier_config = dataclasses.replace(
                config, intermediate_size=widths[0], matformer_tier=layer_tiers[0],
                matformer_layer_tiers=layer_tiers if mixed else None,
            )
            write_json(staging / CONFIG_NAME, to_config_dict(tier_config))
            files = write_weights(slice_state(state, widths), staging, shard_bytes)
            copy_files(common, source, staging)
            listed = [CONFIG_NAME, *files]
            relative = [f"../{target.name}/{name}" for name in listed]
            manifest.tiers.append(TierEntry(
                tier=tier_label(layer_tiers) if mixed else layer_tiers[0],
                intermediate_size=widths[0], files=relative,
                layer_tiers=layer_tiers if mixed else None,
            ))
            for name, path in zip(listed, relative, strict=True):
                manifest.sha256[path] = sha256_of(staging / name)
    write_json_atomic(source / MANIFEST_NAME, manifest.to_dict())
    return manifest


def read_manifest(directory: Path) -> Manifest | None:
    path = Path(directory) / MANIFEST_NAME
    return Manifest.from_dict(read_json(path), str(path)) if path.is_file() else None
