"""Multi-head self-attention with grouped-query heads; the kernel comes from the registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from matformer.modeling.components.init import linear
from matformer.modeling.components.kernels import SdpaAttention
from matformer.modeling.components.positional import PositionalEncoding
from matformer.modeling.generation_cache import KVCache
from matformer.modeling.spec import ModuleSpec, build_module


@dataclass(slots=True)
class AttentionContext:
    """Inputs computed once per forward and shared by every layer's attention."""

    positional: PositionalEncoding
    positional_state: Any  # from positional.prepare (RoPE cos/sin, ALiBi bias...)
    causal: bool
    segment_ids: Tensor | None  # (B, T) int: attend within a segment; 0 = padding
    cache: KVCache | None = None  # generation: the keys and values of earlier positions


@dataclass(slots=True)
class AttentionSubmodules:
    kernel: ModuleSpec | type = SdpaAttention


class SelfAttention(nn.Module):
    """q/k/v/o projections (canonical names) around a registered attention kernel."""

    def __init__(self, config: Any, submodules: AttentionSubmodules, **_: Any) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = linear(config, hidden, self.num_heads * self.head_dim)
        self.k_proj = linear(config, hidden, self.num_kv_heads * self.head_dim)
        self.v_proj = linear(config, hidden, self.num_kv_heads * self.head_dim)
        self.o_proj = linear(config, self.num_heads * self.head_dim, hidden)
        self.kernel = build_module(submodules.kernel, config=config)

    def forward(self, x: Tensor, context: AttentionContext) -> Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # q (B, H, T, D); k, v (B, Hkv, T, D)
        q, k = context.positional.rotate(q, k, context.positional_state)
        causal = context.causal
        if context.cache is not None:
            k, v, past = context.cache.extend(self, k, v)  # (B, Hkv, past + T, D)
            # one new position attends to every cached one; a prompt starts with none
            causal = causal and past == 0
        out = self.kernel(
            q, k, v, causal=causal, segment_ids=context.segment_ids,
            bias=context.positional.score_bias(context.positional_state),
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))  # (B, T, C)
