"""Save a model as a Hugging Face style directory, and load one back."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

from matformer.modeling.atomic import merged_aside
from matformer.modeling.checkpoint.files import (
    CONFIG_NAME,
    read_json,
    read_weights,
    weight_files,
    write_json,
    write_weights,
)
from matformer.modeling.checkpoint.hf_config import (
    from_config_dict,
    is_llama_shaped,
    to_config_dict,
)
from matformer.modeling.checkpoint.manifest import MANIFEST_NAME, is_slice_folder
from matformer.modeling.checkpoint.remote_code import (
    consented,
    module_files,
    pack_code,
    packed_modules,
)
from matformer.modeling.components.buffers import fill_computed_buffers
from matformer.modeling.config import ModelConfig
from matformer.modeling.errors import CheckpointError, ShapeMismatch
from matformer.modeling.layer_spec import model_spec
from matformer.modeling.models import build_model
from matformer.modeling.naming import (
    canonical_names,
    canonical_state_dict,
    load_canonical_state_dict,
)

TIED_HEAD = "lm_head.weight"
EMBEDDING = "model.embed_tokens.weight"


def save_pretrained(
    model: nn.Module, directory: str | Path, *, max_shard_bytes: int | None = None,
    state: Mapping[str, Tensor] | None = None, files: Mapping[str, bytes] | None = None,
) -> Path:
    """Write ``config.json``, the weights (canonical names) and ``files`` (name → content:
    the tokenizer's, say) to ``directory``; ``state``: the weights when ``model`` holds only
    its shards (``DataParallel.full_state``).

    Everything is written aside first. A model already in ``directory`` is replaced: its
    manifest and tier slices go first (they were cut from the old weights), then its weights,
    and ``config.json`` comes last; whatever else the folder holds (a run's checkpoints and
    logs) stays."""
    directory = Path(directory)
    config: ModelConfig = model.config
    state = canonical_state_dict(model, state)
    if config.tie_word_embeddings:
        state.pop(TIED_HEAD, None)  # stored once, as the embedding (as Hugging Face does)
    with merged_aside(directory, last=CONFIG_NAME) as staging:
        staging.mkdir()
        save_model_files(model, staging, files)
        write_weights(state, staging, max_shard_bytes)
        _retire_model(directory)
    return directory


def save_model_files(model: nn.Module, directory: Path,
                     files: Mapping[str, bytes] | None = None) -> None:
    """What a model folder holds besides its weights: ``config.json``, the code of a model
    that is not Llama-shaped, and ``files``. ``model`` may live on the meta device (a
    folder whose weights its holders write themselves, as the shards of a close do)."""
    config: ModelConfig = model.config
    code = None if is_llama_shaped(config) else pack_code(config, module_files(model), directory)
    write_json(directory / CONFIG_NAME, to_config_dict(config, code))
    for name, content in (files or {}).items():
        (directory / name).write_bytes(content)


def _retire_model(directory: Path) -> None:
    """Remove the model ``directory`` holds, if any: manifest, slices, weights."""
    if not (directory / CONFIG_NAME).is_file():
        return
    (directory / MANIFEST_NAME).unlink(missing_ok=True)
    for path in directory.iterdir():
        if is_slice_folder(path):
            shutil.rmtree(path)
    try:
        stale = weight_files(directory)
    except CheckpointError:
        stale = []
    for name in stale:
        (directory / name).unlink(missing_ok=True)


def read_config(directory: str | Path) -> ModelConfig:
    """The checkpoint's ModelConfig, its packed modules (if any) found beside it; nothing is
    imported: building a model from it runs them (see ``load_pretrained``)."""
    directory = Path(directory)
    return packed_modules(from_config_dict(read_json(directory / CONFIG_NAME)), directory)


def check_shapes(model: nn.Module, state: dict[str, Tensor], source: Path) -> None:
    """Raise ShapeMismatch naming the first tensor whose shape the model does not expect."""
    own = model.state_dict()
    for own_name, canonical in canonical_names(model).items():
        if canonical in state and state[canonical].shape != own[own_name].shape:
            raise ShapeMismatch(
                f"{canonical} in {source} has shape {tuple(state[canonical].shape)} but "
                f"config.json describes {tuple(own[own_name].shape)}; the weights and config "
                "come from different models, or the checkpoint was sliced without updating "
                "config.json. Export the checkpoint again."
            )


def _with_tied_head(model: nn.Module, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with the head a tied model shares with its embedding, where it was left out."""
    if model.config.tie_word_embeddings and TIED_HEAD not in state and EMBEDDING in state:
        return {**state, TIED_HEAD: state[EMBEDDING]}
    return state


def load_state_into(model: nn.Module, state: dict[str, Tensor], source: Path) -> None:
    """Check shapes, restore a tied head, and copy canonical tensors into ``model``."""
    state = _with_tied_head(model, state)
    check_shapes(model, state, source)
    load_canonical_state_dict(model, state)


def model_from_state(config: ModelConfig, state: dict[str, Tensor], source: Path,
                     dtype: torch.dtype | None = None) -> nn.Module:
    """The model ``config`` describes, holding ``state``'s tensors (canonical names) as its
    parameters: taken as they are, memory-mapped from the checkpoint, where they have the
    parameter's dtype (``dtype``, else the build's own), else cast once.

    It is built on the meta device, so no weight is drawn only to be overwritten, and its
    computed buffers are then computed for real (``fill_computed_buffers``); a component
    holding a buffer it does not declare gets a real build instead: slower, as exact."""
    model_spec(config)  # imports the config's own modules here: their tensors must be real
    with torch.device("meta"):
        model = build_model(config)
    if not fill_computed_buffers(model):
        model = build_model(config)
    check_shapes(model, state, source)
    names = canonical_names(model)
    wanted = {names[own_name]: dtype if dtype is not None and own.is_floating_point()
              else own.dtype for own_name, own in model.state_dict(keep_vars=True).items()}
    # no copy where a tensor is already as wanted; a tier's slice of a column is copied
    state = {name: tensor.to(wanted.get(name, tensor.dtype)).contiguous()
             for name, tensor in state.items()}
    load_canonical_state_dict(model, _with_tied_head(model, state), assign=True)
    return model if dtype is None else model.to(dtype)  # the computed buffers too, as before


def load_pretrained(directory: str | Path, dtype: torch.dtype | None = None, *,
                    trust_remote_code: bool = False) -> nn.Module:
    """Build the model ``config.json`` describes and load its weights; the checkpoint's own
    module files run only with ``trust_remote_code`` (`remote_code.consented`)."""
    directory = Path(directory)
    config = consented(read_config(directory), trust_remote_code, directory)
    return model_from_state(config, read_weights(directory), directory, dtype)
