"""Microbatched gradient accumulation equals one full-batch backward pass."""

from __future__ import annotations

import pytest
import torch
from support.models import tiny_config

from matformer.modeling import AutoregressiveModel
from matformer.modeling.batch import MaskedBatch
from matformer.modeling.batching import accumulate_gradients, split_microbatches
from matformer.modeling.errors import BatchError

LENGTHS = [5, 17, 9, 30, 2, 12, 1, 23]


@pytest.fixture
def model() -> AutoregressiveModel:
    return AutoregressiveModel(tiny_config())


@pytest.fixture
def examples() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(3, 90, (n,), generator=generator) for n in LENGTHS]


def _full_batch_grads(model, examples, tier=None) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model.loss(MaskedBatch.from_list(examples), tier=tier)
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


SPLITS = {
    "whole": [list(range(len(LENGTHS)))],
    "singletons": [[i] for i in range(len(LENGTHS))],
    "unsorted": [[7, 0], [3], [1, 2, 4, 5, 6]],
    "tokens40_rows2": split_microbatches(LENGTHS, max_tokens=40, max_examples=2),
    "tokens64_rows3": split_microbatches(LENGTHS, max_tokens=64, max_examples=3),
}


@pytest.mark.parametrize("split", list(SPLITS))
def test_microbatched_gradient_equals_full_batch_gradient(model, examples, split):
    reference_loss, reference = _full_batch_grads(model, examples)
    result = accumulate_gradients(model, examples, SPLITS[split])
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, reference[name], atol=1e-6, rtol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert result.loss == pytest.approx(reference_loss, rel=1e-6)
    assert result.targets == sum(n - 1 for n in LENGTHS) == 91
    assert result.tokens == sum(LENGTHS)
    assert result.microbatches == len(SPLITS[split])
    assert result.padded_tokens == sum(len(p) * max(LENGTHS[i] for i in p) for p in SPLITS[split])


def test_weight_and_tier_scale_the_tier_gradient(model, examples):
    _, reference = _full_batch_grads(model, examples, tier=1)
    accumulate_gradients(model, examples, SPLITS["tokens40_rows2"], tier=1, weight=0.25)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, 0.25 * reference[name], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("split", "message"),
    [
        ([[0, 1, 2], [3, 4, 5, 6]], r"missing \[7\]"),
        ([[0, 1, 2, 3], [3, 4, 5, 6, 7]], r"repeated \[3\]"),
        ([[0, 1, 2, 3, 4, 5, 6, 7, 8]], r"out of range \[8\]"),
        ([[0, 1, 2, 3, 4, 5, 6, 7], []], "1 empty"),
    ],
)
def test_microbatches_must_use_every_example_once(model, examples, split, message):
    with pytest.raises(BatchError, match=message):
        accumulate_gradients(model, examples, split)
    assert all(p.grad is None for p in model.parameters())  # checked before any pass


def test_a_batch_without_targets_is_refused(model):
    with pytest.raises(BatchError, match="at least two tokens"):
        accumulate_gradients(model, [torch.tensor([5]), torch.tensor([7])], [[0, 1]])
