"""Transformer blocks built from specs; registered as block/pre and block/post.

Both blocks hold the same submodules under the same (canonical) names and differ only in
where normalisation sits, so a config switches between them with ``normalization_position``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from matformer.modeling.attention import AttentionContext
from matformer.modeling.config import HOOK_POSITIONS
from matformer.modeling.registry import registry
from matformer.modeling.spec import Identity, ModuleSpec, build_module


@dataclass(slots=True)
class BlockSubmodules:
    input_layernorm: ModuleSpec | type = Identity
    self_attn: ModuleSpec | type = Identity
    post_attention_layernorm: ModuleSpec | type = Identity
    mlp: ModuleSpec | type = Identity
    hooks: dict[str, ModuleSpec | type] = field(default_factory=dict)  # position → hook


@registry.register("block", "pre", "torch")
class TransformerBlock(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)); hooks as in components/hooks."""

    # Pre-norm leaves the residual stream unnormalised, so the model adds a final norm.
    needs_final_norm = True

    def __init__(self, config: Any, submodules: BlockSubmodules, **_: Any) -> None:
        super().__init__()
        self.input_layernorm = build_module(submodules.input_layernorm, config=config)
        self.self_attn = build_module(submodules.self_attn, config=config)
        self.post_attention_layernorm = build_module(
            submodules.post_attention_layernorm, config=config
        )
        self.mlp = build_module(submodules.mlp, config=config)
        self.hooks = nn.ModuleDict({
            position: build_module(submodules.hooks.get(position, Identity), config=config)
            for position in HOOK_POSITIONS
        })

    def forward(self, x: Tensor, context: AttentionContext, width: int) -> Tensor:
        hooks = self.hooks
        x = hooks["pre_attn"](x)
        x = x + self.self_attn(self.input_layernorm(x), context)
        x = hooks["pre_mlp"](x)
        x = x + hooks["post_mlp"](self.mlp(self.post_attention_layernorm(x), width))
        return hooks["pre_output"](x)


@registry.register("block", "post", "torch")
class PostNormTransformerBlock(TransformerBlock):
    """Post-norm block (original transformer, BERT): norm(x + attn(x)), norm(x + mlp(x))."""

    needs_final_norm = False

    def forward(self, x: Tensor, context: AttentionContext, width: int) -> Tensor:
        hooks = self.hooks
        x = hooks["pre_attn"](x)
        x = self.input_layernorm(x + self.self_attn(x, context))
        x = hooks["pre_mlp"](x)
        x = self.post_attention_layernorm(x + hooks["post_mlp"](self.mlp(x, width)))
        return hooks["pre_output"](x)
