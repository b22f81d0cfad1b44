"""Positional encodings, registered as positional/<variant>.

One instance per model (``model.embed_positions``). Each may act at three points, and the
defaults do nothing: ``embed`` adds absolute positions to the token embeddings; ``prepare``
computes per-forward state once for all layers; ``rotate`` turns q and k (RoPE);
``score_bias`` adds to the attention scores (ALiBi).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from matformer.modeling.components.buffers import ComputedBuffers
from matformer.modeling.registry import registry


class PositionalEncoding(nn.Module):
    def __init__(self, config: Any, **_: Any) -> None:
        super().__init__()

    def embed(self, x: Tensor, positions: Tensor) -> Tensor:
        return x

    def prepare(self, positions: Tensor, dtype: torch.dtype) -> Any:
        return None

    def rotate(self, q: Tensor, k: Tensor, state: Any) -> tuple[Tensor, Tensor]:
        return q, k

    def score_bias(self, state: Any) -> Tensor | None:
        return None


@registry.register("positional", "nope", "torch")
class NoPositions(PositionalEncoding):
    """NoPE: the causal mask alone carries order."""


@registry.register("positional", "learnable", "torch")
class LearnablePositions(PositionalEncoding):
    """A trained table of one vector per position, added to the token embeddings."""

    def __init__(self, config: Any, **_: Any) -> None:
        super().__init__(config)
        self.weight = nn.Parameter(
            torch.randn(config.max_position_embeddings, config.hidden_size)
            * config.initializer_range
        )

    def embed(self, x, positions):
        return x + self.weight[positions]


@registry.register("positional", "sinusoidal", "torch")
class SinusoidalPositions(PositionalEncoding, ComputedBuffers):
    """The fixed sin/cos table of the original transformer, added to the embeddings."""

    def __init__(self, config: Any, **_: Any) -> None:
        super().__init__(config)
        self.length, self.dim = config.max_position_embeddings, config.hidden_size
        self.scale = config.initializer_range
        self.register_computed_buffers()

    def computed_buffers(self) -> dict[str, Tensor]:
        length, dim = self.length, self.dim
        position = torch.arange(length, dtype=torch.float32)[:, None]
        freq = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(1e4) / dim))
        table = torch.zeros(length, dim)  # (T, C)
        table[:, 0::2] = torch.sin(position * freq)
        table[:, 1::2] = torch.cos(position * freq[: dim // 2])
        # sin/cos have RMS 1/√2; rescale to the token embeddings' init scale so that
        # positions do not drown the tokens (the original scaled tokens up by √C instead).
        table *= self.scale * math.sqrt(2)
        return {"table": table}

    def embed(self, x, positions):
        return x + self.table[positions].to(x.dtype)


@registry.register("positional", "rope", "torch")
class RotaryPositions(PositionalEncoding):
    """RoPE with the half-split layout of Hugging Face Llama (so checkpoints interoperate)."""

    def __init__(self, config: Any, **_: Any) -> None:
        super().__init__(config)
        self.head_dim = config.head_dim
        self.theta = config.rope_theta

    def prepare(self, positions, dtype):
        # Frequencies are computed in fp32 each forward (head_dim/2 values): a buffer would be
        # rounded by model.to(bf16), shifting far angles by tenths of a radian.
        exponents = torch.arange(0, self.head_dim, 2, device=positions.device) / self.head_dim
        inv_freq = 1.0 / self.theta ** exponents.float()
        angles = positions[..., None].float() * inv_freq  # (B, T, D/2)
        angles = torch.cat((angles, angles), dim=-1)  # (B, T, D)
        return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]  # (B, 1, T, D)

    def rotate(self, q, k, state):
        cos, sin = state
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


@registry.register("positional", "alibi", "torch")
class AlibiPositions(PositionalEncoding, ComputedBuffers):
    """ALiBi: each head penalises attention linearly in the query-key distance."""

    def __init__(self, config: Any, **_: Any) -> None:
        super().__init__(config)
        self.heads = config.num_attention_heads
        self.register_computed_buffers()

    def computed_buffers(self) -> dict[str, Tensor]:
        return {"slopes": _alibi_slopes(self.heads)}

    def prepare(self, positions, dtype):
        distance = (positions[:, :, None] - positions[:, None, :]).abs()  # (B, T, T)
        return (-self.slopes[None, :, None, None] * distance[:, None]).to(dtype)  # (B, H, T, T)

    def score_bias(self, state):
        return state


def _alibi_slopes(heads: int) -> Tensor:
    """Geometric slopes 2^(-8i/n); for non-powers of two, interleave the next power's."""
    def powers(n: int) -> list[float]:
        start = 2 ** (-8 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(heads))
    slopes = powers(closest) + powers(2 * closest)[0::2][: heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)
