"""WERSA attention: registered but never picked unasked, and self-consistent.

It approximates softmax attention, so it is not compared with ``sdpa`` token for token.
Instead: its chunked sums equal the quadratic form of the same weights; a padded batch
equals each sequence alone; packed documents equal separate rows; causal outputs ignore
later tokens; padding changes nothing; GQA equals repeated key/value heads; a model trains
and survives a checkpoint; and what it cannot do fails with ``WersaUnsupported``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.models import tiny_config

from matformer.modeling import (
    AutoregressiveModel,
    BERTModel,
    MaskedBatch,
    MatformerError,
    PackedBatch,
    assert_batch_equivalent,
    canonical_names,
    registry,
)
from matformer.modeling.checkpoint import load_pretrained, save_pretrained
from matformer.modeling.components.kernels import SdpaAttention
from matformer.modeling.components.wersa import (
    WersaAttention,
    linear_attention,
    run_starts,
    scale_bands,
)
from matformer.modeling.errors import WersaUnsupported
from matformer.modeling.generation import generate
from matformer.modeling.generation_cache import KVCache
from matformer.modeling.optim import OptimizerConfig

CAUSAL = pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
LENGTHS = [9, 3, 14, 1, 6]


def wersa_config(**overrides):
    layer = {"attn_impl": "wersa", **overrides.pop("default_layer", {})}
    return tiny_config(default_layer=layer, **overrides)


def wersa(chunk: int = 4, head_dim: int = 8) -> WersaAttention:
    """A kernel with small chunks, so that sequences span several of them."""
    attention = WersaAttention(head_dim=head_dim, chunk=chunk)
    with torch.no_grad():  # gates away from 1, so the scale filter is not the identity
        attention.scale_gate.weight.normal_(std=0.5)
        attention.scale_gate.bias.normal_(std=0.5)
    return attention


def qkv(batch: int, length: int, heads: int = 4, kv_heads: int = 2, dim: int = 8):
    return (torch.randn(batch, heads, length, dim), torch.randn(batch, kv_heads, length, dim),
            torch.randn(batch, kv_heads, length, dim))


def sequences(kv_heads: int) -> list[tuple[torch.Tensor, ...]]:
    return [tuple(t[0] for t in qkv(1, n, kv_heads=kv_heads)) for n in LENGTHS]


def right_padded(tensors: list[torch.Tensor], length: int) -> torch.Tensor:
    return torch.stack([F.pad(t, (0, 0, 0, length - t.shape[1])) for t in tensors])


# --- registration -------------------------------------------------------------------------

def kernel_of(model) -> type:
    return type(model.model.layers[0].self_attn.kernel)


def test_registered_below_sdpa_and_used_only_when_asked(monkeypatch):
    impls = {impl.name: impl for impl in registry.implementations("attention", "kernel")}
    assert impls["wersa"].priority < impls["torch"].priority < impls["sdpa"].priority
    assert impls["wersa"].metadata["approximate"] is True
    assert kernel_of(AutoregressiveModel(tiny_config())) is SdpaAttention
    assert kernel_of(AutoregressiveModel(wersa_config())) is WersaAttention
    registry.set_preferences({"attention": {"kernel": "wersa"}})
    assert kernel_of(AutoregressiveModel(tiny_config())) is WersaAttention
    registry.clear_preferences()
    monkeypatch.setenv("MATFORMER_ATTENTION_KERNEL", "wersa")
    assert kernel_of(AutoregressiveModel(tiny_config())) is WersaAttention


# --- the parts against their plain definitions --------------------------------------------

@CAUSAL
@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_chunked_sums_equal_the_quadratic_form(causal, chunk):
    segments = torch.tensor([[1] * 20 + [0] * 4,
                             [1] * 5 + [2] * 9 + [3] + [4] * 7 + [0] * 2,
                             [0] * 3 + [1] * 21,
                             [1] * 24])  # one run, whole chunks: nothing carries into chunk 0
    batch, length = segments.shape
    fq = torch.rand(batch, 2, length, 5, dtype=torch.float64)
    fk = torch.rand(batch, 2, length, 5, dtype=torch.float64)
    v = torch.randn(batch, 2, length, 3, dtype=torch.float64)
    runs = run_starts(segments)
    allowed = (segments[:, :, None] == segments[:, None, :]) & (segments[:, None, :] > 0)
    if causal:
        allowed &= torch.ones(length, length, dtype=torch.bool).tril()
    weights = fq @ fk.transpose(-2, -1) * allowed[:, None]  # (B, H, T, T)
    expected = weights @ v / weights.sum(-1, keepdim=True)
    got = linear_attention(fq, fk, v, runs, causal, chunk)
    real = segments > 0
    torch.testing.assert_close(got.transpose(1, 2)[real], expected.transpose(1, 2)[real])


def test_scale_bands_sum_to_the_input_and_average_within_documents():
    segments = torch.tensor([[1] * 6 + [2] * 10])
    x = torch.randn(1, 1, 16, 3, dtype=torch.float64)
    bands = scale_bands(x, run_starts(segments), levels=2)
    torch.testing.assert_close(sum(bands), x)
    torch.testing.assert_close(bands[-1][0, 0, 7], x[0, 0, 6:8].mean(0))  # 2 of document 2
    torch.testing.assert_close(bands[-1][0, 0, 12], x[0, 0, 9:13].mean(0))  # the last 4


# --- equivalences of the kernel ------------------------------------------------------------

@CAUSAL
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_padded_batch_equals_each_sequence_alone(causal, kv_heads):
    attention = wersa()
    examples = sequences(kv_heads)
    longest = max(LENGTHS)
    batch = [right_padded([example[i] for example in examples], longest) for i in range(3)]
    segments = (torch.arange(longest) < torch.tensor(LENGTHS)[:, None]).int()
    batched = attention(*batch, causal=causal, segment_ids=segments)
    for row, (q, k, v) in enumerate(examples):
        alone = attention(q[None], k[None], v[None], causal=causal)[0]
        torch.testing.assert_close(batched[row, :, :LENGTHS[row]], alone, atol=1e-5, rtol=1e-4)


@CAUSAL
def test_left_padding_changes_nothing(causal):
    attention = wersa()
    q, k, v = qkv(1, 10)
    padded = [F.pad(t, (0, 0, 3, 0), value=7.0) for t in (q, k, v)]
    segments = torch.tensor([[0] * 3 + [1] * 10])
    out = attention(*padded, causal=causal, segment_ids=segments)[:, :, 3:]
    torch.testing.assert_close(out, attention(q, k, v, causal=causal), atol=1e-5, rtol=1e-4)


@CAUSAL
def test_packed_documents_equal_separate_rows(causal):
    attention = wersa()
    examples = sequences(kv_heads=2)
    row = [torch.cat([example[i] for example in examples], dim=1)[None] for i in range(3)]
    segments = torch.cat([torch.full((n,), d + 1) for d, n in enumerate(LENGTHS)])[None]
    packed = attention(*[F.pad(t, (0, 0, 0, 5)) for t in row], causal=causal,
                       segment_ids=F.pad(segments, (0, 5)))  # and padding at the end
    start = 0
    for (q, k, v), n in zip(examples, LENGTHS, strict=True):
        alone = attention(q[None], k[None], v[None], causal=causal)[0]
        torch.testing.assert_close(packed[0, :, start:start + n], alone, atol=1e-5, rtol=1e-4)
        start += n


def test_causal_output_does_not_depend_on_later_tokens():
    attention = wersa()
    q, k, v = (t.requires_grad_() for t in qkv(2, 16))
    out = attention(q, k, v, causal=True)
    position = 6
    grads = torch.autograd.grad(out[:, :, position].sum(), (q, k, v))
    for grad in grads:
        assert grad[:, :, position + 1:].abs().max() == 0
        assert grad[:, :, :position + 1].abs().max() > 0
    changed = [t.detach().clone() for t in (q, k, v)]
    for t in changed:
        t[:, :, position + 1:] = torch.randn_like(t[:, :, position + 1:])
    torch.testing.assert_close(attention(*changed, causal=True)[:, :, :position + 1],
                               out[:, :, :position + 1].detach())


def test_bidirectional_ignores_what_padding_holds():
    attention = wersa()
    q, k, v = qkv(2, 15)
    segments = torch.ones(2, 15, dtype=torch.int32)
    segments[0, 11:] = 0
    segments[1, :4] = 0
    real = segments.bool()
    out = attention(q, k, v, causal=False, segment_ids=segments)
    other = [torch.where(real[:, None, :, None], t, torch.randn_like(t) * 100) for t in (q, k, v)]
    again = attention(*other, causal=False, segment_ids=segments)
    torch.testing.assert_close(again.transpose(1, 2)[real], out.transpose(1, 2)[real])
    assert torch.isfinite(again).all()  # padded queries too, though nobody reads them


@CAUSAL
def test_grouped_query_heads_equal_repeated_key_value_heads(causal):
    attention = wersa()
    q, k, v = qkv(2, 13, kv_heads=2)
    repeated = [t.repeat_interleave(2, dim=1) for t in (k, v)]
    torch.testing.assert_close(attention(q, k, v, causal=causal),
                               attention(q, *repeated, causal=causal))


@CAUSAL
def test_many_random_features_approach_softmax_attention(causal):
    q, k, v = (t * s for t, s in zip(qkv(1, 48, dim=16), (0.5, 0.5, 1.0), strict=True))
    exact = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)

    def error(features: int) -> float:
        with torch.no_grad():
            out = WersaAttention(head_dim=16, features=features)(q, k, v, causal=causal)
        return float((out - exact).abs().mean())

    assert error(4096) < 0.25 * error(16)
    assert error(4096) < 0.1 * float(exact.abs().mean())


# --- whole models -------------------------------------------------------------------------

LAYOUTS = {"padded": MaskedBatch.from_list, "packed": lambda xs: PackedBatch.pack(xs, 16)}


@CAUSAL
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("positional", ["rope", "nope", "learnable"])
def test_model_batched_logits_equal_per_example(causal, layout, positional):
    config = wersa_config(is_causal=causal, default_layer={"positional_encoding": positional})
    model = (AutoregressiveModel if causal else BERTModel)(config).eval()
    for layer in model.model.layers:
        layer.self_attn.kernel.chunk = 4  # documents of a packed row straddle chunks
    generator = torch.Generator().manual_seed(7)
    examples = [torch.randint(3, 90, (n,), generator=generator) for n in LENGTHS]
    with torch.no_grad():
        assert_batch_equivalent(model, examples, LAYOUTS[layout])


def test_model_trains_one_step_with_finite_loss():
    model = AutoregressiveModel(wersa_config())
    optimizer = OptimizerConfig(name="adamw", lr=1e-2).build(model)
    batch = PackedBatch.pack([torch.randint(3, 90, (n,)) for n in LENGTHS], 16)
    loss = model.loss(batch)
    loss.backward()
    gate = model.model.layers[0].self_attn.kernel.scale_gate.weight
    assert torch.isfinite(loss) and gate.grad.abs().sum() > 0
    before = gate.detach().clone()
    optimizer.step()
    assert not torch.equal(gate, before)
    assert torch.isfinite(model.loss(batch))


def test_bfloat16_model_keeps_its_features_in_float32():
    model = AutoregressiveModel(wersa_config()).eval()
    ids = torch.randint(3, 90, (2, 12))
    with torch.no_grad():
        full = model(ids)
        half = model.to(torch.bfloat16)(ids)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), full, atol=0.05, rtol=0.05)


def test_checkpoint_round_trip_gives_equal_logits(tmp_path):
    model = AutoregressiveModel(wersa_config()).eval()
    with torch.no_grad():  # trained-looking WERSA tensors, so that loading them shows
        for name, parameter in model.named_parameters():
            if ".kernel." in name:
                parameter.normal_(std=0.3)
    names = set(canonical_names(model).values())
    assert "model.layers.1.self_attn.kernel.scale_gate.weight" in names
    assert "model.layers.1.self_attn.kernel.log_bandwidth" in names
    assert not any("projection" in name for name in names)  # drawn from the seed, not stored
    save_pretrained(model, tmp_path / "ckpt")
    torch.manual_seed(123)  # another global seed must not change the random features
    loaded = load_pretrained(tmp_path / "ckpt").eval()
    assert isinstance(loaded.model.layers[0].self_attn.kernel, WersaAttention)
    ids = torch.randint(3, 90, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids), atol=0, rtol=0)


# --- what it cannot do -----------------------------------------------------------------------

def test_alibi_is_refused_when_the_model_is_built():
    assert issubclass(WersaUnsupported, MatformerError)
    with pytest.raises(WersaUnsupported, match="'rope' or 'nope'"):
        AutoregressiveModel(wersa_config(default_layer={"positional_encoding": "alibi"}))
    q, k, v = qkv(1, 5)
    with pytest.raises(WersaUnsupported, match="score bias"):
        wersa()(q, k, v, causal=True, bias=torch.zeros(1, 4, 5, 5))


def test_generation_goes_without_the_kv_cache_and_says_so(caplog):
    model = AutoregressiveModel(wersa_config())
    prompt = torch.arange(3, 8)
    with caplog.at_level("WARNING", logger="matformer"):
        out = generate(model, prompt, max_new_tokens=3, temperature=0)
    assert "WersaAttention attention cannot decode from a KV cache" in caplog.text
    assert torch.equal(out, generate(model, prompt, max_new_tokens=3, temperature=0,
                                     use_cache=False))
    cache = KVCache()
    model(prompt[None], cache=cache)
    with pytest.raises(WersaUnsupported, match="use_cache=False"):  # the kernel, asked directly
        model(prompt[None, -1:], position_ids=torch.tensor([[5]]), cache=cache)


def test_a_document_split_into_two_runs_is_refused():
    q, k, v = qkv(1, 6)
    with pytest.raises(WersaUnsupported, match="contiguous run"):
        wersa()(q, k, v, causal=True, segment_ids=torch.tensor([[1, 1, 2, 2, 1, 1]]))


def test_head_size_is_required():
    with pytest.raises(WersaUnsupported, match="head_dim"):
        WersaAttention()
