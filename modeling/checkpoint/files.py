"""Checkpoint directories on disk: config.json + safetensors, single file or sharded.

The layout is Hugging Face's: ``model.safetensors``, or ``model-00001-of-0000N.safetensors``
shards with ``model.safetensors.index.json``. Tensors carry canonical names only. A
directory is written into a temporary sibling and renamed into place, so it appears whole or
not at all.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor

from matformer.modeling.errors import CheckpointError, MissingShard

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def tensor_bytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def write_weights(
    state: dict[str, Tensor], directory: Path, max_shard_bytes: int | None = None
) -> list[str]:
    """Write ``state`` as one file, or as shards + index above ``max_shard_bytes``."""
    state = {name: tensor.detach().contiguous() for name, tensor in state.items()}
    total = sum(tensor_bytes(t) for t in state.values())
    if max_shard_bytes is None or total <= max_shard_bytes:
        save_file(state, directory / WEIGHTS_NAME, metadata={"format": "pt"})
        return [WEIGHTS_NAME]
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        if shards[-1] and size + tensor_bytes(tensor) > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor_bytes(tensor)
    files, weight_map = [], {}
    for number, shard in enumerate(shards, start=1):
        file = part_file(number, len(shards))
        save_file(shard, directory / file, metadata={"format": "pt"})
        files.append(file)
        weight_map.update(dict.fromkeys(shard, file))
    write_index(directory, weight_map, total)
    return [INDEX_NAME, *files]


def part_file(number: int, count: int) -> str:
    """The name of shard ``number`` (from 1) of ``count``, as Hugging Face names them."""
    return f"model-{number:05d}-of-{count:05d}.safetensors"


def write_index(directory: Path, weight_map: dict[str, str], total: int) -> None:
    """``model.safetensors.index.json``: which shard holds each tensor, and their bytes."""
    write_json(directory / INDEX_NAME, {"metadata": {"total_size": total},
                                        "weight_map": weight_map})


def weight_files(directory: Path) -> list[str]:
    """The weights files of a checkpoint directory (index first when sharded)."""
    index = directory / INDEX_NAME
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no 'weight_map'; re-export the checkpoint.")
        return [INDEX_NAME, *sorted(set(weight_map.values()))]
    if (directory / WEIGHTS_NAME).is_file():
        return [WEIGHTS_NAME]
    raise CheckpointError(
        f"{directory} holds no weights: expected {WEIGHTS_NAME} or {INDEX_NAME}."
    )


def shard_bytes(directory: Path) -> int | None:
    """The shard size that writes a copy of ``directory``'s weights sharded as they are (its
    largest shard), or None when they are one file."""
    files = weight_files(directory)
    if files[0] != INDEX_NAME:
        return None
    return max((directory / name).stat().st_size for name in files[1:])


def is_weights_file(path: str) -> bool:
    """Whether a checkpoint file holds weights (a safetensors file or a shard index)."""
    name = path.rsplit("/", 1)[-1]
    return name == INDEX_NAME or name.endswith(".safetensors")


def read_weights(directory: Path, files: Sequence[str] | None = None) -> dict[str, Tensor]:
    """All tensors of a checkpoint directory, single-file or sharded.

    ``files`` (names in ``directory``, index first when sharded, as ``weight_files`` gives
    them) restricts the read to those: a loader passes the files it verified, so nothing
    else in the folder is read, and a shard the index names outside ``files`` is an error.
    """
    files = weight_files(directory) if files is None else list(files)
    if not files or files[0] != INDEX_NAME:
        if files != [WEIGHTS_NAME]:
            raise CheckpointError(
                f"expected {WEIGHTS_NAME} or {INDEX_NAME} with its shards in {directory}, "
                f"got {', '.join(files) or 'no weights files'}."
            )
        return load_file(directory / WEIGHTS_NAME)
    weight_map = read_json(directory / INDEX_NAME).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{directory / INDEX_NAME} has no 'weight_map'; re-export it.")
    shards = sorted(set(weight_map.values()))
    unlisted = [f for f in shards if f not in files]
    if unlisted:
        raise CheckpointError(
            f"{directory / INDEX_NAME} names shard(s) outside the files to read: "
            f"{', '.join(unlisted)}; re-export the checkpoint."
        )
    missing = [f for f in shards if not (directory / f).is_file()]
    if missing:
        raise MissingShard(
            f"{directory / INDEX_NAME} names shard(s) that are not there: {', '.join(missing)}. "
            "Copy the complete checkpoint or export it again."
        )
    state: dict[str, Tensor] = {}
    for file in shards:
        state.update(load_file(directory / file))
    if set(state) != set(weight_map):
        lost = sorted(set(weight_map) ^ set(state))[:5]
        raise CheckpointError(
            f"the shards of {directory} disagree with its index about {', '.join(lost)}; "
            "the checkpoint is corrupt, export it again."
        )
    return state


def read_names(directory: Path, names: Sequence[str]) -> dict[str, Tensor]:
    """The tensors ``names`` of a checkpoint directory, single-file or sharded, reading no
    others (a shard of a coordinator's close reads its part of a checkpoint so). A name the
    checkpoint lacks is a CheckpointError."""
    files = weight_files(directory)
    if files[0] == INDEX_NAME:
        weight_map = read_json(directory / INDEX_NAME)["weight_map"]
    else:
        weight_map = dict.fromkeys(names, WEIGHTS_NAME)
    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(weight_map.get(name, ""), []).append(name)
    if "" in by_file:
        raise CheckpointError(f"{directory} holds no {', '.join(by_file[''][:5])}; the "
                              "checkpoint is another model's, or corrupt.")
    state = {}
    for file, wanted in by_file.items():
        with safe_open(str(directory / file), framework="pt") as opened:
            missing = sorted(set(wanted) - set(opened.keys()))
            if missing:
                raise CheckpointError(f"{directory / file} holds no {', '.join(missing[:5])}; "
                                      "the checkpoint is another model's, or corrupt.")
            for name in wanted:
                state[name] = opened.get_tensor(name)
    return state


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as err:
        raise CheckpointError(f"{path} is missing.") from err
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}).") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object.")
    return data


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def copy_files(names: list[str], source: Path, destination: Path) -> None:
    """Copy files by relative name, creating folders as needed."""
    for name in names:
        (destination / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source / name, destination / name)
