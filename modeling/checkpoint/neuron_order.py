"""A dense checkpoint made nested: each layer's FFN neurons sorted by importance
(docs/architecture.md, "Where things live": a dense model made nested).

Tier ``t`` runs the first ``h / 2**t`` FFN neurons of every layer. A model trained at one
width keeps its important neurons anywhere, so a prefix of it is a random cut. A gated FFN
is a sum over its neurons, ``down[:, j] · act(gate_j · x) · (up_j · x)``, and the sum does
not care about order: permuting the rows of ``gate_proj`` and ``up_proj`` (and their
biases) and the columns of ``down_proj`` by one permutation per layer leaves the model's
function as it was, up to the order of float additions, while choosing what each prefix
holds. Sorted by a score, most important first, every tier's prefix is the best slice of
its size that the score can tell.

Two scores, both measuring how much a neuron adds to the residual stream, so both are
unchanged by rescalings that leave the function unchanged (``up_j · c``, ``down_j / c``):

- ``weights`` (no data): ``||gate_j ⊙ w|| · ||up_j ⊙ w|| · ||down_j||``, ``w`` the gain of
  the norm in front of the FFN. For an input of unit-scale entries ``x̂``, the FFN sees
  ``w ⊙ x̂``, ``gate_j · (w ⊙ x̂)`` has scale ``||gate_j ⊙ w||``, SiLU grows like its input,
  and so the neuron's output has the scale of that product.
- ``activations`` (``Calibration``): ``E|act(gate_j · x) · (up_j · x)| · ||down_j||`` over the
  tokens of calibration sequences: the mean norm of what the neuron adds, measured on the
  inputs it really sees. The mean ``|a_j|`` alone would rank differently after such a
  rescaling, which changes nothing the model computes.

``convert`` writes the ordered model as a new checkpoint, with its tokenizer and the record
of its training data, its ``config.json`` saying how it was ordered
(``matformer_neuron_order``), and tier slices if asked for: all of it built aside and renamed
into place, so the folder appears whole or not at all.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from matformer.modeling.atomic import built_aside
from matformer.modeling.checkpoint.export import common_files, export_tiers
from matformer.modeling.checkpoint.files import (
    CONFIG_NAME,
    copy_files,
    read_weights,
    shard_bytes,
    write_json,
    write_weights,
)
from matformer.modeling.checkpoint.hf_config import (
    NEURON_ORDER_KEY,
    is_llama_shaped,
    to_config_dict,
)
from matformer.modeling.checkpoint.manifest import Manifest
from matformer.modeling.checkpoint.pretrained import model_from_state, read_config
from matformer.modeling.checkpoint.slicing import neuron_axis
from matformer.modeling.config import ModelConfig
from matformer.modeling.errors import (
    AlreadySliced,
    CheckpointExists,
    ConfigError,
    NotConvertible,
    TierError,
)
from matformer.modeling.matformer import layer_widths
from matformer.modeling.mdat import DEFAULT_STRATEGY, Mdat
from matformer.modeling.mdat.trained_on import RECORD_NAME
from matformer.modeling.naming import canonical_state_dict
from matformer.modeling.run_order import RunOrder

log = logging.getLogger("matformer.checkpoint")

FORWARD_TOKENS = 8192  # tokens per calibration forward pass


def ffn_names(layer: int) -> tuple[str, str, str]:
    """The canonical (gate, up, down) weights of ``layer``."""
    return tuple(f"model.layers.{layer}.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))


def weight_scores(state: dict[str, Tensor], layers: int) -> list[Tensor]:
    """Per layer, ``||gate_j ⊙ w|| · ||up_j ⊙ w|| · ||down_j||`` for each neuron ``j``."""
    scores = []
    for layer in range(layers):
        gate, up, down = (state[name].float() for name in ffn_names(layer))
        gain = state.get(f"model.layers.{layer}.post_attention_layernorm.weight")
        if gain is not None:  # the FFN sees the norm's output: w ⊙ x̂
            gate, up = gate * gain.float(), up * gain.float()
        scores.append(gate.norm(dim=1) * up.norm(dim=1) * down.norm(dim=0))  # (h,)
    return scores


@torch.no_grad()
def activation_scores(model: nn.Module, examples: Sequence[Tensor]) -> list[Tensor]:
    """Per layer, ``E|silu(gate_j · x) · (up_j · x)| · ||down_j||`` over every token of
    ``examples``, ``x`` each layer's FFN input, caught by a hook as ``model`` (Llama-shaped:
    SwiGLU) runs at full width. Sequences of one length run together, so no padding enters
    the means."""
    state = canonical_state_dict(model)  # whatever the implementation names its tensors
    layers = model.model.layers
    sums = [torch.zeros(state[ffn_names(i)[0]].shape[0], dtype=torch.float64,
                        device=state[ffn_names(i)[0]].device) for i in range(len(layers))]

    def hook(layer: int):
        gate, up, _ = (state[name].float() for name in ffn_names(layer))

        def measure(module: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].float()  # (B, T, C)
            active = F.silu(F.linear(x, gate)) * F.linear(x, up)  # (B, T, h)
            sums[layer] += active.abs().sum(dim=(0, 1)).double()

        return measure

    handles = [block.mlp.register_forward_pre_hook(hook(i)) for i, block in enumerate(layers)]
    training = model.training
    model.eval()
    try:
        by_length: dict[int, list[Tensor]] = {}
        for example in examples:
            by_length.setdefault(len(example), []).append(example)
        for length, group in by_length.items():
            rows = max(1, FORWARD_TOKENS // length)
            for start in range(0, len(group), rows):
                model(torch.stack(group[start:start + rows]))  # (B, T)
    finally:
        for handle in handles:
            handle.remove()
        model.train(training)
    tokens = sum(len(e) for e in examples)
    return [(total / tokens).float() * state[ffn_names(i)[2]].float().norm(dim=0)
            for i, total in enumerate(sums)]


def orders_of(scores: Sequence[Tensor]) -> list[Tensor]:
    """Per layer, neuron indices by descending score (ties keep their order)."""
    return [torch.sort(score, descending=True, stable=True).indices for score in scores]


def permute_neurons(state: dict[str, Tensor], orders: Sequence[Tensor]) -> dict[str, Tensor]:
    """``state`` with layer ``i``'s FFN neurons in the order ``orders[i]``: new neuron ``k``
    is old neuron ``orders[i][k]``; every other tensor is kept as it is."""
    permuted = {}
    for name, tensor in state.items():
        found = neuron_axis(name)
        if found is not None:
            layer, axis = found
            tensor = tensor.index_select(axis, orders[layer].to(tensor.device))
        permuted[name] = tensor
    return permuted


@dataclass(frozen=True, slots=True)
class Calibration:
    """The sequences the ``activations`` score measures: the first ``sequences`` of the
    training part of an MDAT view's shuffle (what ``matformer-train`` trains on with this
    seed; its held-out tail stays unseen, so held-out figures stay held out)."""

    data: Path  # the MDAT container
    sequences: int = 64
    strategy: str = DEFAULT_STRATEGY["strategy_name"]
    view: str | None = None
    seq_len: int = 256
    seed: int = 0

    def examples(self, config: ModelConfig) -> list[Tensor]:
        """The calibration sequences as token ids; ConfigError when the container's
        vocabulary, or the sequence length, is more than the model has."""
        if self.sequences < 1:
            raise ConfigError(f"--calibration-sequences {self.sequences}: give at least 1.")
        if self.seq_len > config.max_position_embeddings:
            raise ConfigError(
                f"--seq-len {self.seq_len} is longer than the model's max_position_embeddings "
                f"{config.max_position_embeddings}; give a --seq-len of at most that.")
        with Mdat.open(self.data) as mdat:
            reader, order = RunOrder.open(mdat, self.strategy, self.seq_len, self.view,
                                          self.seed, config)
            ids = order.training[:self.sequences]
            examples = [torch.from_numpy(reader[int(i)].astype(np.int64)) for i in ids]
            vocabulary = mdat.strategy(self.strategy).vocab_size
        vocabulary = vocabulary or max(int(e.max()) for e in examples) + 1
        if vocabulary > config.vocab_size:
            raise ConfigError(
                f"{self.data} (strategy {self.strategy!r}) has a vocabulary of {vocabulary:,} "
                f"ids, more than the model's {config.vocab_size:,}; calibrate on data "
                "tokenized with the model's own tokenizer.")
        return examples

    def record(self, examples: Sequence[Tensor]) -> dict[str, Any]:
        return {"data": str(self.data), "strategy": self.strategy, "view": self.view,
                "seq_len": self.seq_len, "seed": self.seed, "sequences": len(examples),
                "tokens": sum(len(e) for e in examples)}


@dataclass(frozen=True, slots=True)
class Conversion:
    """What ``convert`` did: each layer's scores (in the source's order) and new order."""

    out: Path
    score: str
    scores: list[Tensor]
    orders: list[Tensor]
    manifest: Manifest | None  # of the tier slices, when some were written

    def kept(self, widths: Sequence[int]) -> tuple[float, float]:
        """(before, after): the share of each layer's total score that the first
        ``widths[i]`` neurons hold, averaged over layers."""
        before = [float(s[:w].sum() / s.sum()) for s, w in zip(self.scores, widths, strict=True)]
        after = [float(s[o[:w]].sum() / s.sum())
                 for s, o, w in zip(self.scores, self.orders, widths, strict=True)]
        return sum(before) / len(before), sum(after) / len(after)


def check_out(out: Path) -> None:
    """Refuse an ``out`` that is a file or a folder with anything in it."""
    if out.is_file() or (out.is_dir() and any(out.iterdir())):
        raise CheckpointExists(f"{out} exists and is not empty; give a new folder for the "
                              "converted checkpoint, or remove that one first.")


def convertible(source: Path) -> tuple[ModelConfig, dict[str, Tensor]]:
    """The config and weights of a dense Llama-shaped checkpoint, or the error that says why
    ``source`` is none."""
    config = read_config(source)
    if config.matformer_tier != 0:
        raise AlreadySliced(
            f"{source} is the tier {config.matformer_tier} slice of a model; convert the "
            "universal checkpoint it was cut from.")
    if not is_llama_shaped(config):
        raise NotConvertible(
            f"{source} is not Llama-shaped (RoPE, RMSNorm, SwiGLU, no hooks, causal): "
            "matformer-convert orders SwiGLU FFN neurons; convert a Llama checkpoint.")
    state = read_weights(source)
    missing = [n for i in range(config.num_hidden_layers) for n in ffn_names(i) if n not in state]
    if missing:
        raise NotConvertible(
            f"{source} holds no FFN weights {missing[0]} ({len(missing)} missing): there are "
            "no neurons to order; give a checkpoint with its FFN (gate, up, down) weights.")
    return config, state


def convert(source: str | Path, out: str | Path, *, calibration: Calibration | None = None,
            tiers: Sequence[int] = (), device: torch.device | None = None) -> Conversion:
    """Write ``source`` with each layer's FFN neurons sorted by importance to the new folder
    ``out``: by the ``activations`` score on ``calibration``'s sequences, else by the
    ``weights`` score; with the tier slices ``tiers`` (``export_tiers``) inside it."""
    source, out = Path(source), Path(out)
    check_out(out)
    config, state = convertible(source)
    for tier in tiers:  # before any work, and in words of the source, not of the staging
        if tier < 1:
            raise TierError(f"tier {tier}: slices are tiers >= 1; tier 0 is the converted "
                            "model itself.")
        layer_widths(config, tier)
    if calibration is None:
        scores, record = weight_scores(state, config.num_hidden_layers), {"score": "weights"}
    else:
        examples = calibration.examples(config)
        device = device or torch.device("cpu")
        model = model_from_state(config, state, source).to(device)
        scores = activation_scores(model, [e.to(device) for e in examples])
        record = {"score": "activations", **calibration.record(examples)}
    scores = [score.cpu() for score in scores]
    orders = orders_of(scores)
    shared, left_out = common_files(source)
    carried = [name for name in left_out if name == RECORD_NAME]  # the same model, same data
    if set(left_out) - set(carried):
        log.warning("not copied to %s (not tokenizer, generation config, code or %s): %s", out,
                    RECORD_NAME, ", ".join(n for n in left_out if n not in carried))
    manifest = None
    with built_aside(out) as staging:
        staging.mkdir()
        copy_files([*shared, *carried], source, staging)
        write_json(staging / CONFIG_NAME,
                   {**to_config_dict(config), NEURON_ORDER_KEY: record})
        write_weights(permute_neurons(state, orders), staging, shard_bytes(source))
        if tiers:
            manifest = export_tiers(staging, tiers)
    return Conversion(out=out, score=record["score"], scores=scores,
                      orders=orders, manifest=manifest)

