"""Variable-length batches: padded and packed batches give every example its solo result."""

from __future__ import annotations

import pytest
import torch
from support.models import tiny_config

from matformer.modeling import (
    AutoregressiveModel,
    BatchError,
    BERTModel,
    MaskedBatch,
    NakedTransformer,
    PackedBatch,
    assert_batch_equivalent,
    registry,
)
from matformer.modeling.components.kernels import segment_runs
from matformer.modeling.devices import Precision

# Approximations of softmax (wersa) have self-consistency tests of their own (test_wersa.py).
KERNELS = [impl.name for impl in registry.implementations("attention", "kernel")
           if not impl.metadata.get("approximate")]
RUNNABLE = ["torch"] + [name for name in KERNELS if name != "torch"
                        and registry.select("attention", "kernel", name).name == name]
POSITIONAL = registry.variants("positional")
LENGTHS = [9, 3, 14, 1, 6]


def examples(vocab: int = 90) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=generator) for n in LENGTHS]


def packed(xs):
    return PackedBatch.pack(xs, row_length=16)


LAYOUTS = {"padded": MaskedBatch.from_list, "packed": packed}


def test_every_positional_encoding_is_covered():
    assert set(POSITIONAL) == {"nope", "learnable", "sinusoidal", "rope", "alibi"}


def assert_documents_get_their_solo_logits(kernel: str, positional: str, layout: str,
                                           causal: bool, *, device: torch.device | str = "cpu",
                                           precision: Precision | None = None,
                                           atol: float = 1e-5, rtol: float = 1e-4) -> None:
    """A tiny model (attention ``kernel``, ``positional`` encoding) run in ``precision`` gives
    every document of ``examples()`` in a ``layout`` batch the logits it gets alone."""
    config = tiny_config(is_causal=causal, default_layer={
        "attn_impl": kernel, "positional_encoding": positional})
    model = (AutoregressiveModel if causal else BERTModel)(config).eval().to(device)
    documents = [x.to(device) for x in examples()]
    # inference: flex runs its own kernel on CPU (no backward there)
    with torch.no_grad(), (precision or Precision()).autocast():
        assert_batch_equivalent(model, documents, LAYOUTS[layout], atol=atol, rtol=rtol)


@pytest.mark.parametrize("kernel", RUNNABLE)
@pytest.mark.parametrize("positional", POSITIONAL)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "bidirectional"])
def test_batched_logits_equal_per_example(kernel, positional, layout, causal):
    assert_documents_get_their_solo_logits(kernel, positional, layout, causal)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_padding_content_never_reaches_the_result(layout):
    model = AutoregressiveModel(tiny_config()).eval()
    xs = examples()
    with torch.no_grad():
        batches = [LAYOUTS[layout](xs) for _ in range(2)]
        batches[1].data[~batches[1].tokens] = 5  # different pad token, same real tokens
        a, b = (batch.unbatch(model(batch)) for batch in batches)
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_loss_sums_and_gradients_equal_the_per_example_loop(layout):
    model = AutoregressiveModel(tiny_config())
    xs = examples()
    batch = LAYOUTS[layout](xs)
    assert model.num_targets(batch) == sum(n - 1 for n in LENGTHS)
    model.loss(batch, reduction="sum").backward()
    batched = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    total = sum(model.loss(x[None], reduction="sum") for x in xs)
    total.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(batched[name], p.grad, atol=1e-5, rtol=1e-4, msg=name)
    mean = model.loss(batch)
    torch.testing.assert_close(mean, total / model.num_targets(batch), atol=1e-6, rtol=1e-5)


def test_tensor_with_attention_mask_equals_a_masked_batch():
    model = AutoregressiveModel(tiny_config()).eval()
    batch = MaskedBatch.from_list(examples())
    with torch.no_grad():
        torch.testing.assert_close(model(batch), model(batch.data, batch.mask.long()))
        assert model.loss(batch) == model.loss(batch.data, batch.mask.long())


def test_naked_transformer_takes_hidden_states_with_a_static_feature_dim():
    model = NakedTransformer(tiny_config()).eval()
    hidden = [torch.randn(n, 32) for n in LENGTHS]
    with torch.no_grad():
        batch = assert_batch_equivalent(
            model, hidden, lambda xs: MaskedBatch.from_list(xs, dims=(True, False)))
    assert batch.mask.shape == (len(LENGTHS), max(LENGTHS), 1)


def test_masked_batch_layout():
    batch = MaskedBatch.from_list([torch.tensor([4, 5, 6]), torch.tensor([7])], pad_value=-1)
    assert batch.data.tolist() == [[4, 5, 6], [7, -1, -1]]
    assert batch.mask.tolist() == [[True, True, True], [True, False, False]]
    assert batch.dims == (True,)
    assert batch.position_ids.tolist() == [[0, 1, 2], [0, 0, 0]]
    assert [x.tolist() for x in batch.unbatch(batch.data)] == [[4, 5, 6], [7]]


def test_masked_batch_with_two_dynamic_dims():
    batch = MaskedBatch.from_list([torch.ones(2, 3), torch.ones(4, 1)], dims=(True, True))
    assert batch.data.shape == batch.mask.shape == (2, 4, 3)
    assert batch.mask[1].sum() == 4 and batch.mask[0].sum() == 6


def test_pack_is_first_fit_with_per_document_positions():
    batch = PackedBatch.pack([torch.arange(5), torch.arange(4), torch.arange(2)], row_length=7)
    assert batch.spans.tolist() == [[0, 0, 5], [1, 0, 4], [0, 5, 2]]
    assert batch.segment_ids.tolist() == [[1, 1, 1, 1, 1, 2, 2], [1, 1, 1, 1, 0, 0, 0]]
    assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 3, 0, 0, 0]]
    assert [x.tolist() for x in batch.unbatch(batch.data)] == [
        [0, 1, 2, 3, 4], [0, 1, 2, 3], [0, 1]]


@pytest.mark.parametrize("bad, message", [
    ([], "at least one example"),
    ([torch.tensor([1]), torch.tensor([], dtype=torch.long)], "example 1 is empty"),
])
def test_bad_examples_raise_batch_error(bad, message):
    for make in LAYOUTS.values():
        with pytest.raises(BatchError, match=message):
            make(bad)


def test_batch_errors_name_the_problem():
    with pytest.raises(BatchError, match="static dimension 1"):
        MaskedBatch.from_list([torch.ones(2, 3), torch.ones(2, 4)])
    with pytest.raises(BatchError, match="raise row_length"):
        PackedBatch.pack([torch.arange(20)], row_length=16)
    model = AutoregressiveModel(tiny_config())
    batch = MaskedBatch.from_list(examples())
    with pytest.raises(BatchError, match="carries its own mask"):
        model(batch, batch.mask)


def test_equivalence_check_catches_a_leak():
    def leaky(x):  # every position sees the batch-wide mean: examples influence each other
        data = x if isinstance(x, torch.Tensor) else x.data
        return data.float().mean().expand(data.shape)

    with pytest.raises(AssertionError, match="example 0"):
        assert_batch_equivalent(leaky, examples())


def test_segment_runs_for_varlen_kernels():
    segments = torch.tensor([[1, 1, 2, 2, 2, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.int32)
    bounds, longest = segment_runs(segments)
    assert bounds.tolist() == [0, 2, 5, 6, 10, 12] and longest == 4
    assert bounds.dtype == torch.int32
    assert segment_runs(torch.tensor([[1, 0, 1, 1]], dtype=torch.int32)) is None  # a hole
