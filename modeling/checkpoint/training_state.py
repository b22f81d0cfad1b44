"""Optimizer and trainer state beside the weights: tensors in safetensors, the rest in JSON.

A torch ``state_dict`` is a tree of dicts and lists with tensors among its leaves. Each
tensor is stored under its path in the tree (``optimizers.0.state.3.exp_avg``) and replaced
in the JSON by a reference to that key, so nothing is ever pickled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from matformer.modeling.atomic import write_json_atomic
from matformer.modeling.checkpoint.files import read_json
from matformer.modeling.errors import CheckpointError

STATE_TENSORS = "training_state.safetensors"
STATE_JSON = "training_state.json"
_TENSOR = "__tensor__"


def split_tensors(tree: Any, prefix: str = "state") -> tuple[Any, dict[str, torch.Tensor]]:
    """(skeleton, tensors): ``tree`` with each tensor replaced by a reference to its key in
    ``tensors`` (its path under ``prefix``); the skeleton is plain JSON data."""
    tensors: dict[str, torch.Tensor] = {}
    return _split(tree, prefix, tensors), tensors


def join_tensors(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The tree ``split_tensors`` took apart; KeyError names a tensor ``tensors`` lacks."""
    return _join(skeleton, tensors)


def _split(tree: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        tensors[path] = tree.detach().contiguous()
        return {_TENSOR: path}
    if isinstance(tree, dict):
        # JSON keys are strings; remember which were ints (torch keys param state by index)
        return {"__dict__": [[key, _split(value, f"{path}.{key}", tensors)]
                             for key, value in tree.items()]}
    if isinstance(tree, list | tuple):
        return [_split(value, f"{path}.{i}", tensors) for i, value in enumerate(tree)]
    if tree is None or isinstance(tree, bool | int | float | str):
        return tree
    raise CheckpointError(f"cannot store {type(tree).__name__} at {path} without pickling.")


def _join(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(tree, dict) and _TENSOR in tree:
        return tensors[tree[_TENSOR]]
    if isinstance(tree, dict):
        return {key: _join(value, tensors) for key, value in tree["__dict__"]}
    if isinstance(tree, list):
        return [_join(value, tensors) for value in tree]
    return tree


def save_training_state(directory: str | Path, state: dict[str, Any]) -> None:
    """Write a (nested) state dict, e.g. ``{"step": 10, "optimizer": opt.state_dict()}``."""
    directory = Path(directory)
    skeleton, tensors = split_tensors(state)
    save_file(tensors, directory / STATE_TENSORS)
    write_json_atomic(directory / STATE_JSON, {"state": skeleton})


def load_training_state(directory: str | Path) -> dict[str, Any]:
    directory = Path(directory)
    tensors = load_file(directory / STATE_TENSORS) if (directory / STATE_TENSORS).is_file() else {}
    skeleton = read_json(directory / STATE_JSON)["state"]
    try:
        return join_tensors(skeleton, tensors)
    except KeyError as err:
        raise CheckpointError(
            f"{directory / STATE_JSON} refers to tensor {err} missing from {STATE_TENSORS}; "
            "the two files come from different saves."
        ) from err
