"""Transformer blocks built from specs; registered as block/pre and block/post.

Both blocks hold the same submodules under the same (canonical) names and differ only in
where normalisation sits, so a config switches between them with ``normalization_position``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from matformer.modeling.attention import AttentionContext
from matformer.modeling.config import HOOK_POSITIONS
from matformer.modeling.registry import registry
from matformer.modeling.spec import Identity, ModuleSpec, build_module


@registry.register("residual", "bias_dropout_add", "torch")
class BiasDropoutAdd(nn.Module):
    """residual + dropout(out): how a sublayer's output joins the residual stream; dropout
    (``hidden_dropout``) only while training. Its own submodule of the block, so a fused
    variant is a registry entry or a spec."""

    def __init__(self, config: Any = None, **_: Any) -> None:
        super().__init__()
        self.p = getattr(config, "hidden_dropout", 0.0)

    def forward(self, out: Tensor, residual: Tensor) -> Tensor:
        if self.training and self.p:
            out = F.dropout(out, self.p)
        return residual + out


@dataclass(slots=True)
class BlockSubmodules:
    input_layernorm: ModuleSpec | type = Identity
    self_attn: ModuleSpec | type = Identity
    self_attn_bda: ModuleSpec | type = BiasDropoutAdd
    # cross-attention (a decoder over an encoder's states): left out unless given
    pre_cross_attn_layernorm: ModuleSpec | type = Identity
    cross_attn: ModuleSpec | type = Identity
    cross_attn_bda: ModuleSpec | type = BiasDropoutAdd
    post_attention_layernorm: ModuleSpec | type = Identity
    mlp: ModuleSpec | type = Identity
    mlp_bda: ModuleSpec | type = BiasDropoutAdd
    hooks: dict[str, ModuleSpec | type] = field(default_factory=dict)  # position → hook


@registry.register("block", "pre", "torch")
class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); hooks as in components/hooks.

    ``layer_number`` (1 for the first block, as Megatron counts) is given to every submodule
    it builds, so a component may read its depth."""

    # Pre-norm leaves the residual stream unnormalised, so the model adds a final norm.
    needs_final_norm = True

    def __init__(self, config: Any, submodules: BlockSubmodules, layer_number: int | None = None,
                 **_: Any) -> None:
        super().__init__()
        self.layer_number = layer_number

        def build(spec: ModuleSpec | type) -> nn.Module:
            return build_module(spec, config=config, layer_number=layer_number)

        self.input_layernorm = build(submodules.input_layernorm)
        self.self_attn = build(submodules.self_attn)
        self.self_attn_bda = build(submodules.self_attn_bda)
        self.encoder_attn = self.encoder_attn_layer_norm = self.cross_attn_bda = None
        if submodules.cross_attn is not Identity:
            self.encoder_attn_layer_norm = build(submodules.pre_cross_attn_layernorm)
            self.encoder_attn = build(submodules.cross_attn)
            self.cross_attn_bda = build(submodules.cross_attn_bda)
        self.post_attention_layernorm = build(submodules.post_attention_layernorm)
        self.mlp = build(submodules.mlp)
        self.mlp_bda = build(submodules.mlp_bda)
        self.hooks = nn.ModuleDict({
            position: build(submodules.hooks.get(position, Identity))
            for position in HOOK_POSITIONS
        })

    def forward(self, x: Tensor, context: AttentionContext, width: int) -> Tensor:
        hooks = self.hooks
        x = hooks["pre_attn"](x)
        x = self.self_attn_bda(self.self_attn(self.input_layernorm(x), context), x)
        if self.encoder_attn is not None:
            x = self.cross_attn_bda(self.encoder_attn(self.encoder_attn_layer_norm(x), context), x)
        x = hooks["pre_mlp"](x)
        x = self.mlp_bda(hooks["post_mlp"](self.mlp(self.post_attention_layernorm(x), width)), x)
        return hooks["pre_output"](x)


@registry.register("block", "post", "torch")
class PostNormTransformerBlock(TransformerBlock):
    """Post-norm block (original transformer, BERT): norm(x + attn(x)), norm(x + mlp(x))."""

    needs_final_norm = False

    def forward(self, x: Tensor, context: AttentionContext, width: int) -> Tensor:
        hooks = self.hooks
        x = hooks["pre_attn"](x)
        x = self.input_layernorm(self.self_attn_bda(self.self_attn(x, context), x))
        if self.encoder_attn is not None:
            x = self.encoder_attn_layer_norm(
                self.cross_attn_bda(self.encoder_attn(x, context), x))
        x = hooks["pre_mlp"](x)
        x = self.post_attention_layernorm(self.mlp_bda(hooks["post_mlp"](self.mlp(x, width)), x))
        return hooks["pre_output"](x)
