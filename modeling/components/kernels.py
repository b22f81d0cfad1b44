"""Attention kernels: softmax(q·kᵀ/√d + bias, masked) · v, registered as attention/kernel.

Every kernel takes q (B, H, T, D) and k, v (B, Hkv, T, D) with H a multiple of Hkv
(grouped-query attention), an optional additive ``bias`` broadcastable to (B, H, T, T), a
``causal`` flag and optional ``segment_ids`` (B, T): a query attends only to keys of its own
segment, and segment 0 is padding that no query attends to. Padded batches have segments 0/1;
packed batches number the documents of a row from 1, which makes attention block-diagonal.
They agree with the plain-math ``torch`` reference on every query row that is a real token.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from matformer.modeling.registry import registry

log = logging.getLogger("matformer.attention")


def allowed_mask(
    causal: bool, segment_ids: Tensor | None, length: int, device: torch.device
) -> Tensor | None:
    """Boolean (B|1, 1, T, T) mask of the score entries a query may attend to, or None."""
    mask = None
    if causal:
        mask = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None, None]
    if segment_ids is not None:
        keys = segment_ids[:, None, None, :]  # (B, 1, 1, T)
        same = (segment_ids[:, None, :, None] == keys) & (keys > 0)  # (B, 1, T, T)
        mask = same if mask is None else mask & same
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

    decodes_with_cache = True  # takes fewer queries than keys (generation's KV cache)

    def __init__(self, config: Any = None, **_: Any) -> None:
        super().__init__()

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, causal: bool,
        segment_ids: Tensor | None = None, bias: Tensor | None = None,
        dropout_p: float = 0.0,
    ) -> Tensor:
        """``dropout_p``: of the attention probabilities (given only while training with
        ``attention_dropout``; a kernel that cannot drop them hands the call to SDPA)."""
        raise NotImplementedError


@registry.register("attention", "kernel", "torch", priority=0,
                   metadata={"doc": "plain matmul/softmax reference"})
class TorchAttention(AttentionKernel):
    """The reference: every step written out, no fused kernel."""

    def forward(self, q, k, v, *, causal, segment_ids=None, bias=None, dropout_p=0.0):
        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1)  # (B, H, T, D)
        v = v.repeat_interleave(groups, dim=1)
        scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5  # (B, H, T, T)
        allowed = allowed_mask(causal, segment_ids, q.shape[2], q.device)
        mask = additive_mask(bias, allowed, scores.dtype)
        if mask is not None:
            scores = scores + mask
        probs = scores.softmax(dim=-1)
        if dropout_p:
            probs = F.dropout(probs, dropout_p)
        return probs @ v


@registry.register("attention", "kernel", "sdpa", priority=20,
                   metadata={"doc": "torch.nn.functional.scaled_dot_product_attention"})
class SdpaAttention(AttentionKernel):
    """PyTorch's fused scaled_dot_product_attention; the default everywhere."""

    def forward(self, q, k, v, *, causal, segment_ids=None, bias=None, dropout_p=0.0):
        gqa = q.shape[1] != k.shape[1]
        if bias is None and segment_ids is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa,
                                                  dropout_p=dropout_p)
        allowed = allowed_mask(causal, segment_ids, q.shape[2], q.device)
        mask = additive_mask(bias, allowed, q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa,
                                              dropout_p=dropout_p)


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

    def forward(self, q, k, v, *, causal, segment_ids=None, bias=None, dropout_p=0.0):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        args = dict(causal=causal, segment_ids=segment_ids, bias=bias)
        if dropout_p:
            return self.delegate("has no attention dropout", q, k, v, **args,
                                 dropout_p=dropout_p)
        if not q.is_cuda:
            if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
                return self.delegate("has no backward on CPU", q, k, v, **args)
            q, k, v = q.detach(), k.detach(), v.detach()  # flex refuses grad-tracking CPU input
        batch, length = q.shape[0], q.shape[2]
        block_mask = None
        if causal or segment_ids is not None:
            seg = segment_ids

            def mask_mod(b, h, q_idx, kv_idx):
                keep = q_idx >= kv_idx if causal else q_idx >= 0
                if seg is None:
                    return keep
                return keep & (seg[b, q_idx] == seg[b, kv_idx]) & (seg[b, kv_idx] > 0)

            # Blocks that no query may read (other documents of a packed row) are skipped.
            block_mask = create_block_mask(
                mask_mod, B=batch if seg is not None else None, H=None,
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
                   metadata={"doc": "flash-attn 2 (CUDA, fp16/bf16), varlen for packed rows"})
class FlashAttention(DelegatingKernel):
    """flash-attn's fused kernel on fp16/bf16 CUDA tensors.

    With segments (padding or packed documents) it runs the varlen kernel: every run of one
    segment is its own sequence, so no token attends across a document or into padding.
    Additive biases (ALiBi) and segments that are not contiguous go to SDPA instead.
    """

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def forward(self, q, k, v, *, causal, segment_ids=None, bias=None, dropout_p=0.0):
        args = dict(causal=causal, segment_ids=segment_ids, bias=bias, dropout_p=dropout_p)
        if bias is not None:
            return self.delegate("takes no additive bias", q, k, v, **args)
        if q.dtype not in (torch.float16, torch.bfloat16) or not q.is_cuda:
            return self.delegate("needs fp16/bf16 CUDA tensors", q, k, v, **args)
        if segment_ids is None:
            from flash_attn import flash_attn_func

            out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                  dropout_p=dropout_p, causal=causal)  # (B, T, H, D) in, out
            return out.transpose(1, 2)
        runs = segment_runs(segment_ids)
        if runs is None:
            return self.delegate("needs contiguous segments", q, k, v, **args)
        return self._varlen(q, k, v, causal, *runs, dropout_p=dropout_p)

    @staticmethod
    def _varlen(q: Tensor, k: Tensor, v: Tensor, causal: bool, starts: Tensor,
                longest: int, dropout_p: float = 0.0) -> Tensor:
        from flash_attn import flash_attn_varlen_func

        batch, heads, length, dim = q.shape

        def tokens(x: Tensor) -> Tensor:  # (B, H, T, D) → (B·T, H, D)
            return x.transpose(1, 2).reshape(batch * length, x.shape[1], dim)

        out = flash_attn_varlen_func(tokens(q), tokens(k), tokens(v), starts, starts,
                                     longest, longest, dropout_p=dropout_p, causal=causal)
        return out.reshape(batch, length, heads, dim).transpose(1, 2)


def segment_runs(segment_ids: Tensor) -> tuple[Tensor, int] | None:
    """(cumulative run starts as int32, longest run) over the flattened rows, or None when
    some document is split into several runs (a hole), which varlen kernels cannot express.

    Padding runs become sequences of their own: their outputs are never read.
    """
    batch, length = segment_ids.shape
    flat = segment_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::length] = True  # a row always starts a run
    real_runs = int((starts & (flat > 0)).sum())
    documents = segment_ids.long() + (segment_ids.max().long() + 1) * torch.arange(
        batch, device=segment_ids.device)[:, None]
    if real_runs != int(documents[segment_ids > 0].unique().numel()):
        return None
    bounds = torch.cat([starts.nonzero().flatten(),
                        torch.tensor([flat.numel()], device=flat.device)]).to(torch.int32)
    return bounds, int((bounds[1:] - bounds[:-1]).max())
