"""Every attention kernel agrees with the plain-math reference, masks and biases included."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from support.models import tiny_config

from matformer.modeling import AutoregressiveModel, BERTModel, registry
from matformer.modeling.components.positional import AlibiPositions
from matformer.modeling.devices import Precision

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


def assert_kernel_matches_reference(name: str, causal: bool, pad: str, kv_heads: int,
                                    alibi: bool, *, device: torch.device | str = "cpu",
                                    dtype: torch.dtype = torch.float32,
                                    atol: float = 2e-5, rtol: float = 1e-4) -> None:
    """Kernel ``name`` on ``dtype`` inputs gives the float32 reference's outputs and input
    gradients on every query that is a real token."""
    batch, heads, length, dim = 3, 4, 12, 8
    drawn = [torch.randn(batch, h, length, dim) for h in (heads, kv_heads, kv_heads)]
    inputs = [x.to(device, dtype).requires_grad_() for x in drawn]  # q, k, v
    exact = [x.detach().float().requires_grad_() for x in inputs]  # the reference's
    seg = segments(pad, batch, length)
    seg = seg if seg is None else seg.to(device)
    bias = exact_bias = None
    if alibi:
        positional = AlibiPositions(tiny_config(num_attention_heads=heads)).to(device)
        positions = torch.arange(length, device=device).expand(batch, length)
        bias, exact_bias = (positional.score_bias(positional.prepare(positions, d))
                            for d in (dtype, torch.float32))
    kernel = registry.get("attention", "kernel", name)()
    reference = registry.get("attention", "kernel", "torch")()
    args = dict(causal=causal, segment_ids=seg)
    real = seg > 0 if seg is not None else torch.ones(batch, length, dtype=torch.bool,
                                                       device=device)
    expected = reference(*exact, **args, bias=exact_bias)
    with torch.no_grad():  # inference: flex runs its own kernel even on CPU
        out = kernel(*inputs, **args, bias=bias)
    # compare only queries that are real tokens: padded rows are never read
    torch.testing.assert_close(out.transpose(1, 2)[real].float(),
                               expected.transpose(1, 2)[real], atol=atol, rtol=rtol)
    out = kernel(*inputs, **args, bias=bias)
    grad = torch.randn_like(out) * real[:, None, :, None]
    got = torch.autograd.grad(out, inputs, grad)
    want = torch.autograd.grad(expected, exact, grad.float())
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b, atol=atol, rtol=rtol)


def assert_model_logits_match_reference(name: str, model_cls: type, *,
                                        device: torch.device | str = "cpu",
                                        precision: Precision | None = None,
                                        atol: float = 1e-5, rtol: float = 1e-4) -> None:
    """A tiny model whose layers use kernel ``name``, run in ``precision``, gives the float32
    logits of the same weights on the ``torch`` reference kernel, padded positions aside."""
    causal = model_cls is AutoregressiveModel
    torch.manual_seed(1)
    reference = model_cls(tiny_config(is_causal=causal, default_layer={"attn_impl": "torch"}))
    model = model_cls(tiny_config(is_causal=causal, default_layer={"attn_impl": name}))
    model.load_state_dict(reference.state_dict())
    reference.to(device)
    model.to(device)
    ids = torch.randint(0, 90, (2, 10)).to(device)
    mask = torch.ones(2, 10, dtype=torch.long, device=device)
    mask[0, -3:] = 0
    real = mask.bool()
    with torch.no_grad():
        want = reference(ids, mask)[real]
        with (precision or Precision()).autocast():
            got = model(ids, mask)[real]
        torch.testing.assert_close(got.float(), want, atol=atol, rtol=rtol)


@pytest.mark.parametrize("name", RUNNABLE)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
@pytest.mark.parametrize("pad", ["none", "left", "right", "packed"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("alibi", [False, True], ids=["", "alibi"])
def test_kernel_matches_reference(name, causal, pad, kv_heads, alibi):
    assert_kernel_matches_reference(name, causal, pad, kv_heads, alibi)


@pytest.mark.parametrize("name", RUNNABLE)
@pytest.mark.parametrize("model_cls", [AutoregressiveModel, BERTModel])
def test_whole_model_gives_the_same_logits_with_every_kernel(name, model_cls):
    assert_model_logits_match_reference(name, model_cls)
