"""MicrobatchRunner: retries a batch after injected out-of-memory errors, losing nothing."""

from __future__ import annotations

import pytest
import torch
from support.models import tiny_config

from matformer.modeling import AutoregressiveModel
from matformer.modeling.batch import MaskedBatch
from matformer.modeling.batching import (
    AdaptiveLimitsConfig,
    MicrobatchLimits,
    MicrobatchRunner,
    padded_tokens,
)
from matformer.modeling.errors import BatchDoesNotFit, BatchError

LENGTHS = [20, 3, 17, 9, 30, 2, 12, 23]  # longest 30: regime 5


@pytest.fixture
def model() -> AutoregressiveModel:
    return AutoregressiveModel(tiny_config())


@pytest.fixture
def examples() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    return [torch.randint(3, 90, (n,), generator=generator) for n in LENGTHS]


def _runner(model, **overrides) -> MicrobatchRunner:
    fields = dict(max_examples=8, max_tokens=256, stable_steps=2)
    fields.update(overrides)
    return MicrobatchRunner(model, AdaptiveLimitsConfig(**fields).build())


class FakeStep:
    """Runs a backward per microbatch, then runs out of memory if it had > ``threshold``
    padded tokens, leaving that half-accumulated gradient behind."""

    def __init__(self, model: AutoregressiveModel, lengths: list[int], threshold: int) -> None:
        self.model, self.lengths, self.threshold = model, lengths, threshold
        self.plans: list[list[list[int]]] = []

    def __call__(self, plan: list[list[int]]) -> list[list[int]]:
        self.plans.append(plan)
        weight = self.model.lm_head.weight
        for microbatch in plan:
            (weight.sum() * len(microbatch)).backward()  # grad counts rows processed
            if padded_tokens([self.lengths[i] for i in microbatch]) > self.threshold:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return plan


def test_oom_shrinks_the_regime_and_retries_the_same_batch(model):
    runner = _runner(model)
    step = FakeStep(model, LENGTHS, threshold=70)
    plan = runner.run(LENGTHS, step)
    # 8 rows (240 tokens) → 4 rows (120) → 2 rows (60) fits; examples bound each time.
    assert [max(len(m) for m in p) for p in step.plans] == [8, 4, 2]
    assert sorted(i for m in plan for i in m) == list(range(len(LENGTHS)))
    # Failed attempts left no gradient behind: one unit per row of the successful attempt.
    assert torch.equal(model.lm_head.weight.grad, torch.full_like(model.lm_head.weight, 8.0))
    assert runner.limits.limits(30) == MicrobatchLimits(max_examples=2, max_tokens=256)
    assert runner.limits.limits(31).max_examples == 2  # same regime (17..32)
    assert runner.limits.limits(16).max_examples == 8  # shorter sequences keep theirs


def test_the_regime_remembers_its_limits_and_grows_them_after_stable_steps(model):
    runner = _runner(model)  # stable_steps=2
    runner.run(LENGTHS, FakeStep(model, LENGTHS, threshold=70))  # 8 → 4 → 2 rows, success
    step = FakeStep(model, LENGTHS, threshold=70)
    runner.run(LENGTHS, step)  # starts at 2 rows: no OOM; second success in a row
    assert len(step.plans) == 1
    assert runner.limits.limits(30).max_examples == 4  # grown back by 2x
    step = FakeStep(model, LENGTHS, threshold=70)
    runner.run(LENGTHS, step)  # 4 rows do not fit: shrink again and retry
    assert [max(len(m) for m in p) for p in step.plans] == [4, 2]


def test_tokens_shrink_when_rows_are_not_the_binding_limit(model):
    runner = _runner(model, max_examples=8, max_tokens=120)
    step = FakeStep(model, LENGTHS, threshold=45)
    runner.run(LENGTHS, step)
    biggest = [max(padded_tokens([LENGTHS[i] for i in m]) for m in p) for p in step.plans]
    assert biggest == [120, 60, 30]  # 120 → max_tokens 60 → 32 (floor: one 32-token row)
    assert runner.limits.limits(30) == MicrobatchLimits(max_examples=8, max_tokens=32)


def test_oom_at_the_floor_raises_batch_does_not_fit(model):
    runner = _runner(model)
    step = FakeStep(model, LENGTHS, threshold=10)
    with pytest.raises(BatchDoesNotFit, match="ran out of memory") as caught:
        runner.run(LENGTHS, step)
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
    assert [max(len(m) for m in p) for p in step.plans] == [8, 4, 2, 1]
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    "error", [ValueError("bad input"), RuntimeError("CUDA error: device-side assert triggered")]
)
def test_errors_other_than_oom_propagate_untouched(model, error):
    runner = _runner(model)

    def attempt(plan):
        raise error

    with pytest.raises(type(error)) as caught:
        runner.run(LENGTHS, attempt)
    assert caught.value is error
    assert runner.limits.limits(30) == MicrobatchLimits(max_examples=8, max_tokens=256)


def test_an_empty_batch_is_refused(model):
    with pytest.raises(BatchError, match="at least one example"):
        _runner(model).run([], lambda plan: plan)


def test_cuda_cache_is_emptied_before_a_retry(model, monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    _runner(model).run(LENGTHS, FakeStep(model, LENGTHS, threshold=70))
    assert calls == ["empty", "empty"]


def test_accumulate_after_an_oom_mid_batch_equals_the_full_batch_gradient(
    model, examples, monkeypatch
):
    reference_loss = model.loss(MaskedBatch.from_list(examples))
    reference_loss.backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    loss = model.labelled_loss
    calls = []

    def flaky_loss(batch, labels, **kwargs):
        calls.append(batch.data.shape[0])
        if len(calls) == 2:  # the second microbatch of the first attempt, after a backward
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")
        return loss(batch, labels, **kwargs)

    monkeypatch.setattr(model, "labelled_loss", flaky_loss)
    result = _runner(model, max_examples=4).accumulate(examples)
    assert calls == [4, 4, 2, 2, 2, 2]  # failed plan: 4+4 rows; retry: 2+2+2+2
    assert result.loss == pytest.approx(reference_loss.item(), rel=1e-6)
    assert result.microbatches == 4
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, reference[name], atol=1e-6, rtol=1e-5)
