"""Every attention kernel agrees with the plain-math reference, masks and biases included."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from conftest import tiny_config

from matformer.modeling import AutoregressiveModel, BERTModel, registry
from matformer.modeling.components.positional import AlibiPositions

# Approximations of softmax (wersa) have self-consistency tests of their own (test_wersa.py).
KERNELS = [impl.name for impl in registry.implementations("attention", "kernel")
           if not impl.metadata.get("approximate")]
RUNNABLE = [name for name in KERNELS if name != "torch"
            and registry.select("attention", "kernel", name).name == name]


def segments(kind: str, batch: int, length: int) -> torch.Tensor | None:
    """Segment ids (B, T): padding on one side (0/1), or several documents per row."""
    if kind == "none":
        return None
    ids = torch.ones(batch, length, dtype=torch.int32)
    for row in range(batch):
        pad = 1 + 2 * row
        if kind == "left":
            ids[row, :pad] = 0
        elif kind == "right":
            ids[row, length - pad:] = 0
        else:  # packed: documents of 2 + row, 5 and the rest, then padding
            cuts = [0, 2 + row, 7 + row, length - row]
            for number, (start, end) in enumerate(pairwise(cuts), start=1):
                ids[row, start:end] = number
            ids[row, length - row:] = 0
    return ids


def test_every_registered_kernel_is_checked_or_unavailable_here():
    assert {"sdpa", "flex"} <= set(RUNNABLE)
    assert set(KERNELS) == {"torch", "sdpa", "flex", "flash"}


@pytest.mark.parametrize("name", RUNNABLE)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("pad", ["none", "left", "right", "packed"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("alibi", [False, True], ids=["", "alibi"])
def test_kernel_matches_reference(name, causal, pad, kv_heads, alibi):
    batch, heads, length, dim = 3, 4, 12, 8
    q = torch.randn(batch, heads, length, dim, requires_grad=True)
    k = torch.randn(batch, kv_heads, length, dim, requires_grad=True)
    v = torch.randn(batch, kv_heads, length, dim, requires_grad=True)
    seg = segments(pad, batch, length)
    bias = None
    if alibi:
        positional = AlibiPositions(tiny_config(num_attention_heads=heads))
        positions = torch.arange(length).expand(batch, length)
        bias = positional.score_bias(positional.prepare(positions, torch.float32))
    kernel = registry.get("attention", "kernel", name)()
    reference = registry.get("attention", "kernel", "torch")()
    args = dict(causal=causal, segment_ids=seg, bias=bias)
    real = seg > 0 if seg is not None else torch.ones(batch, length, dtype=torch.bool)
    expected = reference(q, k, v, **args)
    with torch.no_grad():  # inference: flex runs its own kernel even on CPU
        out = kernel(q, k, v, **args)
    # compare only queries that are real tokens: padded rows are never read
    torch.testing.assert_close(out.transpose(1, 2)[real], expected.transpose(1, 2)[real],
                               atol=2e-5, rtol=1e-4)
    out = kernel(q, k, v, **args)
    grad = torch.randn_like(out) * real[:, None, :, None]
    got = torch.autograd.grad(out, (q, k, v), grad)
    want = torch.autograd.grad(expected, (q, k, v), grad)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", RUNNABLE)
@pytest.mark.parametrize("model_cls", [AutoregressiveModel, BERTModel])
def test_whole_model_gives_the_same_logits_with_every_kernel(name, model_cls, monkeypatch):
    config = tiny_config(is_causal=model_cls is AutoregressiveModel)
    torch.manual_seed(1)
    reference = model_cls(tiny_config(is_causal=config.is_causal,
                                      default_layer={"attn_impl": "torch"}))
    model = model_cls(tiny_config(is_causal=config.is_causal, default_layer={"attn_impl": name}))
    model.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 90, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, -3:] = 0
    real = mask.bool()
    with torch.no_grad():
        torch.testing.assert_close(model(ids, mask)[real], reference(ids, mask)[real],
                                   atol=1e-5, rtol=1e-4)
