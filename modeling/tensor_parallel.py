"""Tensor parallelism: every block's attention heads and FFN neurons split over the ranks of
a 1-D device mesh, by PyTorch's own plans (docs/architecture.md, "Batches, devices and
several devices").

    mesh = init_device_mesh("cuda", (world_size,))
    model = parallelize(build_model(config), mesh)  # rank 0's weights, split
    logits = model(ids, tier=1)                     # same ids in, same logits out, every rank
    state = gather_canonical(model)                 # whole tensors, canonical names and order

q/k/v_proj are split column-wise (each rank computes its own heads) and o_proj row-wise;
gate/up_proj column-wise and down_proj row-wise. Embeddings, norms and lm_head stay
replicated: every rank computes them whole, which costs little next to the blocks.

Tiers stay balanced. Cut into R contiguous blocks, the canonical prefix of a tier would sit
on the first ranks alone. Instead rank r holds canonical neurons r, r+R, r+2R, ...
(``balanced_order``), so the first w/(2**t·R) neurons of every rank's shard are, together,
exactly the canonical prefix of w/2**t, for every tier t at once. Each rank narrows its own
shard (``local_prefix``): tier t under tensor parallelism is canonical tier t, every rank
does the same share of it, and the tail of every shard gets exactly zero gradient.
``parallelize`` applies that order and ``gather_canonical`` undoes it, so checkpoints,
export and federated rounds only ever see the canonical order.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)

from matformer.modeling.attention import SelfAttention
from matformer.modeling.checkpoint.neuron_order import permute_neurons
from matformer.modeling.checkpoint.slicing import neuron_axis
from matformer.modeling.components.mlp import GeGLU, GeluMLP, SwiGLU
from matformer.modeling.components.positional import PositionalEncoding
from matformer.modeling.errors import NotParallelizable, UnevenSplit
from matformer.modeling.matformer import layer_widths
from matformer.modeling.models import TransformerWithLMHead
from matformer.modeling.naming import canonical_state_dict, load_canonical_state_dict

SPLIT_FFNS = (SwiGLU, GeGLU, GeluMLP)  # FFNs whose forward narrows through mlp.prefix


def balanced_order(width: int, ranks: int) -> Tensor:
    """The canonical neuron at each position of the tensor-parallel layout: rank r's block
    (positions r·w/R onwards) holds canonical neurons r, r+R, r+2R, ..."""
    return torch.arange(width).view(width // ranks, ranks).t().reshape(-1)


def canonical_order(width: int, ranks: int) -> Tensor:
    """The inverse of ``balanced_order``: the layout position of each canonical neuron."""
    return torch.arange(width).view(ranks, width // ranks).t().reshape(-1)


def check_parallelizable(model: TransformerWithLMHead, ranks: int) -> None:
    """Raise what keeps ``model`` from splitting over ``ranks``, before anything is split."""
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise NotParallelizable(
            "this model is already split (FSDP2's fully_shard, or an earlier parallelize); "
            "apply tensor parallelism once, to a plain model, and train it without --fsdp: "
            "Matformer does not combine the two.")
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % ranks or kv_heads % ranks:
        raise UnevenSplit(
            f"{heads} attention heads and {kv_heads} key/value heads do not split over {ranks} "
            "ranks; each rank takes whole heads, so use a rank count that divides both.")
    for index, width in enumerate(layer_widths(config)):
        if width % ranks:
            raise UnevenSplit(
                f"layer {index}'s FFN holds {width} neurons, which do not split over {ranks} "
                "ranks; use a rank count that divides every layer's width (a Mix'n'Match "
                "slice's narrowest layer included), or the universal checkpoint.")
    if type(model.model.embed_positions).score_bias is not PositionalEncoding.score_bias:
        raise NotParallelizable(
            f"{config.default_layer.positional_encoding} positions add a bias per attention "
            "head, which is not split with the heads; use rope (or another encoding without "
            "a score bias) under tensor parallelism.")
    for index, layer in enumerate(model.model.layers):
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if type(attention) is not SelfAttention:
            raise NotParallelizable(
                f"layer {index}'s attention is {type(attention).__name__}, not the "
                "SelfAttention that tensor parallelism splits by heads.")
        if any(True for _ in attention.kernel.parameters()):
            raise NotParallelizable(
                f"layer {index}'s attention kernel {type(attention.kernel).__name__} has "
                "weights shared by every head, whose gradient each rank would see only in "
                "part; use a kernel without weights (sdpa, flash, flex or torch).")
        if type(mlp) not in SPLIT_FFNS:
            raise NotParallelizable(
                f"layer {index}'s FFN is {type(mlp).__name__}; tensor parallelism splits the "
                "torch FFNs (swiglu, geglu, gelu): prefer their torch implementation "
                "(MATFORMER_MLP_<ACTIVATION>=torch or registry.set_preferences).")


def parallelize(model: TransformerWithLMHead, mesh: DeviceMesh) -> TransformerWithLMHead:
    """``model`` split in place over the ranks of ``mesh`` (1-D; every rank calls this) and
    returned. It starts from rank 0's weights, in canonical order."""
    if mesh.ndim != 1:
        raise NotParallelizable(f"tensor parallelism takes a 1-D device mesh, not {mesh}.")
    ranks = mesh.size()
    check_parallelizable(model, ranks)
    with torch.no_grad():
        orders = [balanced_order(width, ranks) for width in layer_widths(model.config)]
        ffn = {name: t for name, t in canonical_state_dict(model).items() if neuron_axis(name)}
        load_canonical_state_dict(model, permute_neurons(ffn, orders), strict=False)
    for layer in model.model.layers:
        attention = layer.self_attn
        attention.num_heads //= ranks  # its view of q/k/v sees only this rank's heads
        attention.num_kv_heads //= ranks
        parallelize_module(layer, mesh, block_plan(layer.mlp))
        # the FFN's partial sums added up over the ranks (a second call: one style a module)
        parallelize_module(layer.mlp, mesh, PrepareModuleOutput(
            output_layouts=Partial(), desired_output_layouts=Replicate()))
    # The split weights came from rank 0 (distribute_tensor's default); so do the rest.
    group = mesh.get_group()
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            if not isinstance(tensor, DTensor):
                dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
    return model


def block_plan(mlp: nn.Module) -> dict[str, ParallelStyle]:
    """How one block splits: by heads in attention, by neurons in the FFN."""
    # Attention and FFN take the block's (replicated) activations as one DTensor each, so
    # their input gradient is summed over the ranks once per branch, not once per matrix.
    replicated = dict(input_layouts=(Replicate(), None), desired_input_layouts=(Replicate(), None))
    plan: dict[str, ParallelStyle] = {
        "self_attn": PrepareModuleInput(**replicated),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(),
        # The FFN calls F.linear on its (narrowed) weights, not its Linear modules, so the
        # projections' plans only split the weights, and the FFN's own input and output
        # plans carry the activations (its output: ``parallelize``).
        "mlp": PrepareModuleInput(**replicated),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(),
    }
    if hasattr(mlp, "gate_proj"):
        plan["mlp.gate_proj"] = ColwiseParallel()
    return plan


def local_prefix(weight: DTensor, dim: int, width: int) -> DTensor:
    """The tier prefix of ``width`` neurons of an FFN weight split along ``dim``: on every
    rank the first width/R neurons of its own shard (the balanced layout, module docstring).
    A view, as the unsplit prefix is, so the rest of the shard gets zero gradient."""
    ranks = weight.device_mesh.size()
    if tuple(weight.placements) != (Shard(dim),):
        raise NotParallelizable(
            f"an FFN weight split as {weight.placements} cannot be narrowed to a tier; only "
            "tensor parallelism's split along the neurons can (parallelize).")
    if width % ranks:
        raise UnevenSplit(
            f"a tier of {width} FFN neurons does not split over {ranks} ranks; under tensor "
            f"parallelism every tier's width must be a multiple of {ranks}: use a shallower "
            "tier (or a Mix'n'Match list of them), or fewer ranks.")
    local = weight.to_local().narrow(dim, 0, width // ranks)
    return DTensor.from_local(local, weight.device_mesh, weight.placements, run_check=False)


def gather_canonical(model: TransformerWithLMHead,
                     tensors: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Whole tensors under canonical names, FFN neurons in canonical order, on the CPU: of
    ``tensors`` (keyed as the model's state dict, e.g. ``{n: p.grad for n, p in
    model.named_parameters()}``), by default the model's weights. A collective: every rank
    calls it."""
    whole = {name: (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu()
             for name, t in (model.state_dict() if tensors is None else tensors).items()}
    ranks = model.model.layers[0].mlp.down_proj.weight.device_mesh.size()
    orders = [canonical_order(width, ranks) for width in layer_widths(model.config)]
    return permute_neurons(canonical_state_dict(model, whole), orders)
