"""Attention kernels: softmax(q·kᵀ/√d + bias, masked) · v, registered as attention/kernel.

Every kernel takes q (B, H, T, D) and k, v (B, Hkv, T, D) with H a multiple of Hkv
(grouped-query attention), an optional additive ``bias`` broadcastable to (B, H, T, T), a
``causal`` flag and an optional ``key_padding_mask`` (B, T), True for real tokens. They
agree with the plain-math ``torch`` reference on every query row that is a real token.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from modeling.registry import registry

log = logging.getLogger("matformer.attention")


def allowed_mask(
    causal: bool, key_padding_mask: Tensor | None, length: int, device: torch.device
) -> Tensor | None:
    """Boolean (B|1, 1, T, T) mask of the score entries a query may attend to, or None."""
    mask = None
    if causal:
        mask = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
    if key_padding_mask is not None:
        keys = key_padding_mask[:, None, None, :].to(torch.bool)  # (B, 1, 1, T)
        mask = keys if mask is None else mask & keys
    return mask


def additive_mask(
    bias: Tensor | None, allowed: Tensor | None, dtype: torch.dtype
) -> Tensor | None:
    """Fold bias and mask into one float tensor; masked entries get the dtype's minimum.

    A finite minimum (not -inf) keeps rows with no allowed key finite instead of NaN.
    """
    if allowed is None:
        return bias
    floor = torch.finfo(dtype).min
    base = torch.zeros((), dtype=dtype, device=allowed.device) if bias is None else bias
    return base.masked_fill(~allowed, floor)


class AttentionKernel(nn.Module):
    """Base class; subclasses implement ``forward`` with the signature below."""

    def __init__(self, config: Any = None, **_: Any) -> None:
        super().__init__()

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool,
        key_padding_mask: Tensor | None = None, bias: Tensor | None = None,
    ) -> Tensor:
        raise NotImplementedError


@registry.register("attention", "kernel", "torch", priority=0,
                   metadata={"doc": "plain matmul/softmax reference"})
class TorchAttention(AttentionKernel):
    """The reference: every step written out, no fused kernel."""

    def forward(self, q, k, v, *, causal, key_padding_mask=None, bias=None):
        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1)  # (B, H, T, D)
        v = v.repeat_interleave(groups, dim=1)
        scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5  # (B, H, T, T)
        allowed = allowed_mask(causal, key_padding_mask, q.shape[2], q.device)
        mask = additive_mask(bias, allowed, scores.dtype)
        if mask is not None:
            scores = scores + mask
        return scores.softmax(dim=-1) @ v


@registry.register("attention", "kernel", "sdpa", priority=20,
                   metadata={"doc": "torch.nn.functional.scaled_dot_product_attention"})
class SdpaAttention(AttentionKernel):
    """PyTorch's fused scaled_dot_product_attention; the default everywhere."""

    def forward(self, q, k, v, *, causal, key_padding_mask=None, bias=None):
        gqa = q.shape[1] != k.shape[1]
        if bias is None and key_padding_mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        allowed = allowed_mask(causal, key_padding_mask, q.shape[2], q.device)
        mask = additive_mask(bias, allowed, q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)


class DelegatingKernel(AttentionKernel):
    """A specialised kernel that hands inputs it cannot take to SDPA, saying so once."""

    def __init__(self, config: Any = None, **_: Any) -> None:
        super().__init__()
        self.sdpa = SdpaAttention()
        self._reported = False

    def delegate(self, reason: str, q: Tensor, k: Tensor, v: Tensor, **kwargs: Any) -> Tensor:
        if not self._reported:
            log.warning("matformer: %s attention %s; using sdpa for such inputs",
                        type(self).matformer_implementation.name, reason)
            self._reported = True
        return self.sdpa(q, k, v, **kwargs)


@registry.register("attention", "kernel", "flex", priority=5,
                   metadata={"doc": "torch flex_attention (compile it for speed)"})
class FlexAttention(DelegatingKernel):
    """torch's flex_attention with the mask as a block mask and the bias as a score_mod.

    torch has no flex_attention backward on CPU, so CPU training steps go to SDPA.
    """

    @classmethod
    def is_available(cls) -> bool:
        try:
            import torch.nn.attention.flex_attention  # noqa: F401
        except ImportError:
            return False
        return True

    def forward(self, q, k, v, *, causal, key_padding_mask=None, bias=None):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        args = dict(causal=causal, key_padding_mask=key_padding_mask, bias=bias)
        if not q.is_cuda:
            if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
                return self.delegate("has no backward on CPU", q, k, v, **args)
            q, k, v = q.detach(), k.detach(), v.detach()  # flex refuses grad-tracking CPU input
        batch, length = q.shape[0], q.shape[2]
        block_mask = None
        if causal or key_padding_mask is not None:
            pad = key_padding_mask

            def mask_mod(b, h, q_idx, kv_idx):
                keep = q_idx >= kv_idx if causal else q_idx >= 0
                return keep & pad[b, kv_idx] if pad is not None else keep

            block_mask = create_block_mask(
                mask_mod, B=batch if pad is not None else None, H=None,
                Q_LEN=length, KV_LEN=length, device=q.device,
            )
        score_mod = None
        if bias is not None:
            full = bias.expand(batch, q.shape[1], length, length)

            def score_mod(score, b, h, q_idx, kv_idx):
                return score + full[b, h, q_idx, kv_idx]

        return flex_attention(
            q, k, v, score_mod=score_mod, block_mask=block_mask,
            enable_gqa=q.shape[1] != k.shape[1],
        )


@registry.register("attention", "kernel", "flash", priority=10, requires=["flash_attn"],
                   metadata={"doc": "flash-attn 2 (CUDA, fp16/bf16)"})
class FlashAttention(DelegatingKernel):
    """flash-attn's fused kernel for causal or full attention on unpadded fp16/bf16 batches.

    Padding masks and additive biases (ALiBi) go to SDPA instead, which handles them exactly.
    """

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def forward(self, q, k, v, *, causal, key_padding_mask=None, bias=None):
        from flash_attn import flash_attn_func

        args = dict(causal=causal, key_padding_mask=key_padding_mask, bias=bias)
        if bias is not None or key_padding_mask is not None:
            return self.delegate("takes no padding mask or bias", q, k, v, **args)
        if q.dtype not in (torch.float16, torch.bfloat16) or not q.is_cuda:
            return self.delegate("needs fp16/bf16 CUDA tensors", q, k, v, **args)
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              causal=causal)  # (B, T, H, D) layout in and out
        return out.transpose(1, 2)
