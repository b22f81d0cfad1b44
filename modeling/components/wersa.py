"""WERSA attention (Wavelet-Enhanced Random Spectral Attention, arXiv 2507.08637), registered
as attention/kernel ``wersa``: an approximation of softmax attention in linear time and memory.

Per head, in three steps:

1. **Scale filter.** q and k are split along the sequence into Haar bands: the smooth part
   at level j is the mean of the last 2**j positions (the stationary, causal form of the
   Haar transform, which moves with the text and so treats a document the same wherever a
   row puts it); each band is the difference of two neighbouring smooth parts, the last band
   the coarsest smooth part, so the bands add up to the input. A learned, content-adaptive
   gate per band and token, ``2·sigmoid(scale_gate(x))``, reweights them: 1 everywhere at
   initialisation, where the filter is the identity.
2. **Random features.** Positive random features (Performer's FAVOR+) with a learned
   bandwidth, φ(x) = exp(ωᵀx − |x|²/2): E[φ(q)·φ(k)] = exp(q·k / (bandwidth·√D)), the
   softmax kernel. ω is drawn from a fixed seed, so a rebuilt or reloaded model draws the same.
3. **Linear attention.** out_t = Σ_s φ(q_t)·φ(k_s) v_s / Σ_s φ(q_t)·φ(k_s) over the keys s of
   t's document (s ≤ t when causal), in chunks: exact products within a chunk, running sums
   of φ(k)vᵀ across chunks.

Windows, running sums and masks stop at document edges (a change of segment id), so packed
documents never see each other, nor padding (segment 0), whose runs stand apart too. What
WERSA cannot compute raises ``WersaUnsupported``: an additive score bias (ALiBi), keys
longer than the queries (decoding with a KV cache), a document split into several runs of
one row.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from itertools import pairwise
from typing import Any

import torch
from torch import Tensor, nn

from matformer.modeling.components.buffers import ComputedBuffers
from matformer.modeling.components.kernels import AttentionKernel, segment_runs
from matformer.modeling.components.positional import PositionalEncoding
from matformer.modeling.errors import WersaUnsupported
from matformer.modeling.registry import registry


def run_starts(keys: Tensor) -> Tensor:
    """(B, T) → (B, T): the index of the first position of each position's run of equal keys."""
    length = keys.shape[1]
    position = torch.arange(length, device=keys.device).expand_as(keys)
    opens = torch.ones_like(keys, dtype=torch.bool)
    opens[:, 1:] = keys[:, 1:] != keys[:, :-1]
    return torch.where(opens, position, 0).cummax(dim=1).values


def doubling_sums(x: Tensor, start: Tensor, levels: int) -> Iterator[Tensor]:
    """Sums of ``x`` along dim 2 over the last 2, 4, ..., 2**levels positions of each
    position's run, one level at a time (``start``: (B, T) from ``run_starts``).

    Each level adds the sums one window earlier when that window lies in the same run, so
    with 2**levels >= T the last level is a prefix sum that restarts at every run.
    """
    length = x.shape[2]
    position = torch.arange(length, device=x.device)
    trailing = (1,) * (x.dim() - 3)
    width = 1
    for _ in range(levels):
        same_run = (position - width >= start).view(*start.shape[:1], 1, length, *trailing)
        x = x + x.roll(width, dims=2) * same_run
        width *= 2
        yield x


def run_prefix_sums(x: Tensor, start: Tensor) -> Tensor:
    """Prefix sums of ``x`` along dim 2 that restart at every run."""
    sums = x
    for level in doubling_sums(x, start, math.ceil(math.log2(x.shape[2]))):
        sums = level  # only the last level is wanted; each earlier one is freed in turn
    return sums


def scale_bands(x: Tensor, start: Tensor, levels: int) -> list[Tensor]:
    """The causal Haar bands of x (B, H, T, D) along T, finest first; they sum to x."""
    position = torch.arange(x.shape[2], device=x.device)
    smooth = [x]
    for level, sums in enumerate(doubling_sums(x, start, levels), start=1):
        count = torch.clamp(position - start + 1, max=2**level)  # fewer at a run's start
        smooth.append(sums / count[:, None, :, None])
    return [fine - coarse for fine, coarse in pairwise(smooth)] + [smooth[-1]]


def within_chunks(fq: Tensor, fk: Tensor, v: Tensor, runs: Tensor, causal: bool) -> Tensor:
    """Weighted sums over the keys of the query's own chunk and run (B, H, N, C, E)."""
    allowed = runs[:, :, :, None] == runs[:, :, None, :]  # (B, N, C, C)
    if causal:
        allowed = allowed.tril()
    weights = fq @ fk.transpose(-2, -1) * allowed[:, None]  # (B, H, N, C, C)
    return weights @ v


def from_earlier_chunks(fq: Tensor, fk: Tensor, v: Tensor, runs: Tensor) -> Tensor:
    """Weighted sums over the keys of the query's run that lie in earlier chunks.

    fq, fk (B, H, N, C, M); v (B, H, N, C, E); runs (B, N, C), nondecreasing along a row.
    Only a chunk's last run can go on into the next chunk, so each chunk passes on
    Σ φ(k)vᵀ over the keys of its last run, summed over the chunks that run spans.
    """
    last, first = runs[:, :, -1], runs[:, :, 0]  # (B, N)
    in_last_run = (runs == last[:, :, None])[:, None, :, :, None]  # (B, 1, N, C, 1)
    state = run_prefix_sums((fk * in_last_run).transpose(-2, -1) @ v, run_starts(last))
    # chunk c takes what chunk c - 1 passes on, for its queries of that same run
    goes_on = last.roll(1, dims=1) == first
    goes_on[:, 0] = False
    carry = state.roll(1, dims=2) * goes_on[:, None, :, None, None]  # (B, H, N, M, E)
    reached = (runs == first[:, :, None])[:, None, :, :, None]
    return (fq @ carry) * reached


def linear_attention(fq: Tensor, fk: Tensor, v: Tensor, runs: Tensor, causal: bool,
                     chunk: int) -> Tensor:
    """Σ_s w_ts v_s / Σ_s w_ts with w_ts = fq_t·fk_s over the keys s of t's run (s <= t when
    causal), linear in T; fq, fk (B, H, T, M), v (B, H, T, D); runs (B, T): a number per run
    that grows along the row (``run_starts`` gives one)."""
    batch, heads, length, dim = v.shape
    v = torch.cat((v, torch.ones_like(v[..., :1])), dim=-1)  # the last column sums the weights
    extra = -length % chunk
    if extra:  # a run of its own fills the last chunk; its keys have no weight
        pad = (0, 0, 0, extra)
        fq, fk, v = (nn.functional.pad(t, pad) for t in (fq, fk, v))
        runs = torch.cat((runs, (runs[:, -1:] + 1).expand(batch, extra)), dim=1)
    chunks = (length + extra) // chunk
    fq, fk, v = (t.view(batch, heads, chunks, chunk, -1) for t in (fq, fk, v))
    runs = runs.view(batch, chunks, chunk)
    sums = within_chunks(fq, fk, v, runs, causal) + from_earlier_chunks(fq, fk, v, runs)
    if not causal:  # the later chunks are the earlier ones of the reversed row
        flipped = (t.flip(2, 3) for t in (fq, fk, v))
        sums = sums + from_earlier_chunks(*flipped, -runs.flip(1, 2)).flip(2, 3)
    sums = sums.view(batch, heads, chunks * chunk, dim + 1)[:, :, :length]
    # a query whose keys' features all underflowed has both sums 0 and gets 0, not NaN
    return sums[..., :dim] / sums[..., dim:].clamp_min(torch.finfo(sums.dtype).tiny)


def random_projection(head_dim: int, features: int, seed: int) -> Tensor:
    """ω (D, M), i.i.d. N(0, 1) from torch's CPU generator: the same numbers on every machine."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(head_dim, features, generator=generator, device="cpu")


@registry.register("attention", "kernel", "wersa", priority=-10,
                   metadata={"doc": "WERSA: Haar-filtered random-feature attention, linear "
                                    "time (an approximation of softmax)",
                             "approximate": True})
class WersaAttention(AttentionKernel, ComputedBuffers):
    """WERSA (module docstring). Priority below torch's 0: used only when asked for
    (``attn_impl = "wersa"``, ``MATFORMER_ATTENTION_KERNEL=wersa`` or set_preferences).

    Tensors, shared by every head: ``scale_gate.weight`` (levels + 1, D) and
    ``scale_gate.bias`` (levels + 1), the band gates; ``log_bandwidth`` (), the kernel's
    log temperature. ω is a buffer that checkpoints do not hold.
    """

    decodes_with_cache = False  # the queries' filter needs the earlier queries

    def __init__(self, config: Any = None, *, head_dim: int | None = None, levels: int = 3,
                 features: int = 64, chunk: int = 64, seed: int = 0, **_: Any) -> None:
        super().__init__()
        if config is not None:
            head_dim = config.head_dim
            reject_score_bias(config)
            if getattr(config, "attention_dropout", 0.0):
                raise WersaUnsupported(
                    "WERSA attention forms no attention probabilities to drop; set "
                    "attention_dropout = 0 (hidden_dropout still applies) or use sdpa.")
        if head_dim is None:
            raise WersaUnsupported("WERSA attention needs the head size: pass the model "
                                   "config, or head_dim=.")
        self.levels, self.chunk = levels, chunk
        self.scale_gate = nn.Linear(head_dim, levels + 1)
        nn.init.zeros_(self.scale_gate.weight)
        nn.init.zeros_(self.scale_gate.bias)
        self.log_bandwidth = nn.Parameter(torch.zeros(()))
        self.head_dim, self.num_features, self.seed = head_dim, features, seed
        self.register_computed_buffers()

    def computed_buffers(self) -> dict[str, Tensor]:
        return {"projection": random_projection(self.head_dim, self.num_features, self.seed)}

    def forward(self, q, k, v, *, causal, segment_ids=None, bias=None):
        check_inputs(q, k, bias, segment_ids)
        batch, heads, length, _ = q.shape
        if segment_ids is None:
            segment_ids = torch.ones(batch, length, dtype=torch.long, device=q.device)
        start = run_starts(segment_ids)  # (B, T): also numbers the runs of a row
        with torch.autocast(q.device.type, enabled=False):  # exp features need float32
            fq = self.features(q.float(), start, stable=True)  # (B, H, T, M)
            fk = self.features(k.float(), start, stable=False)  # (B, Hkv, T, M)
            groups = heads // k.shape[1]
            fk = fk.repeat_interleave(groups, dim=1)
            values = v.float().repeat_interleave(groups, dim=1)
            out = linear_attention(fq, fk, values, start, causal, self.chunk)
        return out.to(q.dtype)

    def features(self, x: Tensor, start: Tensor, stable: bool) -> Tensor:
        """φ of the scale-filtered x (B, H, T, D) → (B, H, T, M)."""
        gate = self.scale_gate
        gates = 2 * torch.sigmoid(gate(x.to(gate.weight.dtype)).float())  # (B, H, T, levels+1)
        bands = scale_bands(x, start, self.levels)
        filtered = sum(gates[..., j, None] * band for j, band in enumerate(bands))
        # scaled by (bandwidth·√D)^(-1/2), so that φ(q)·φ(k) ≈ exp(q·k / (bandwidth·√D))
        scaled = filtered * torch.exp(-self.log_bandwidth.float() / 2) * x.shape[-1] ** -0.25
        logits = scaled @ self.projection.float() - scaled.square().sum(-1, keepdim=True) / 2
        if stable:  # a query's own factor cancels in its ratio: remove its largest
            logits = logits - logits.amax(-1, keepdim=True).detach()
        return logits.exp()  # keys: at most exp(|ω|²/2), finite in float32


def reject_score_bias(config: Any) -> None:
    """Fail at build time for a positional encoding that adds a score bias (ALiBi)."""
    name = config.default_layer.positional_encoding
    if registry.get("positional", name).score_bias is not PositionalEncoding.score_bias:
        raise WersaUnsupported(
            f"WERSA attention cannot take the score bias of positional encoding {name!r}: it "
            "never forms the score matrix. Use 'rope' or 'nope' with it, or attn_impl 'sdpa'.")


def check_inputs(q: Tensor, k: Tensor, bias: Tensor | None, segment_ids: Tensor | None) -> None:
    """Fail on inputs WERSA does not compute, saying what to use instead."""
    if bias is not None:
        raise WersaUnsupported(
            "WERSA attention cannot add a score bias (ALiBi): it never forms the score matrix. "
            "Use positional_encoding 'rope' or 'nope' with it, or attn_impl 'sdpa'.")
    if k.shape[2] != q.shape[2]:
        raise WersaUnsupported(
            f"WERSA attention got {q.shape[2]} queries for {k.shape[2]} keys (decoding with a "
            "KV cache): its queries' filter needs the earlier queries, which no cache keeps. "
            "Generate with use_cache=False, or use attn_impl 'sdpa'.")
    if segment_ids is not None and segment_runs(segment_ids) is None:
        raise WersaUnsupported(
            "WERSA attention needs every document in one contiguous run of its row (segment "
            "ids that come back after another segment were given); pack documents whole "
            "(PackedBatch), or use attn_impl 'sdpa'.")
