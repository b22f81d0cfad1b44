"""Multi-head self-attention with grouped-query heads; the kernel comes from the registry."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
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
    # what cross-attention reads: (B, S, C) states of another stack (an encoder's) and
    # their (B, S) mask, 1 = real; None: no such states (a block without cross-attention)
    encoder_states: Tensor | None = None
    encoder_mask: Tensor | None = None


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
        self.dropout_p = getattr(config, "attention_dropout", 0.0)

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
        # dropout is named only while it applies, so a kernel without it still serves eval
        dropout = {"dropout_p": self.dropout_p} if self.training and self.dropout_p else {}
        out = self.kernel(
            q, k, v, causal=causal, segment_ids=context.segment_ids,
            bias=context.positional.score_bias(context.positional_state), **dropout,
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))  # (B, T, C)


class CrossAttention(SelfAttention):
    """Queries from the block's stream, keys and values from ``context.encoder_states``:
    every position may read every real encoder position (no causal mask, no positional
    rotation: the two sequences share no positions). Same projections and kernels as
    self-attention, under the block's ``encoder_attn`` (Hugging Face's name for it)."""

    def forward(self, x: Tensor, context: AttentionContext) -> Tensor:
        memory = context.encoder_states
        if memory is None:
            raise ValueError("this block cross-attends: pass encoder_states (B, S, C) to the "
                             "model's forward, or build the block without cross_attn.")
        batch, length, _ = x.shape
        source = memory.shape[1]
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(memory).view(batch, source, self.num_kv_heads, self.head_dim)
        v = self.v_proj(memory).view(batch, source, self.num_kv_heads, self.head_dim)
        bias = None
        if context.encoder_mask is not None:  # (B, 1, 1, S): padding reads nothing
            floor = torch.finfo(q.dtype).min
            bias = torch.zeros(batch, 1, 1, source, dtype=q.dtype, device=q.device)
            bias = bias.masked_fill(~context.encoder_mask.bool()[:, None, None, :], floor)
        dropout = {"dropout_p": self.dropout_p} if self.training and self.dropout_p else {}
        out = self.kernel(q, k.transpose(1, 2), v.transpose(1, 2), causal=False,
                          segment_ids=None, bias=bias, **dropout)  # (B, H, T, D)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))  # (B, T, C)
