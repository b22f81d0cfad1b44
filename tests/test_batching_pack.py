"""Packed batches: the planner's waste on mixed lengths, and packed gradients equal padded."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.models import tiny_config

from matformer.modeling import AutoregressiveModel, BERTModel, TransformerWithLMHead
from matformer.modeling.batching import (
    AdaptiveLimitsConfig,
    MicrobatchRunner,
    pack_rows,
    plan_batches,
    plan_packed,
)
from matformer.modeling.batching.plan import window_runs
from matformer.modeling.errors import SequenceTooLong
from matformer.modeling.training import TierSchedule, tier_gradients

BUDGET, ROW = 16_384, 2048


def log_uniform_lengths(count=5000, low=16, high=2048, seed=0) -> list[int]:
    draw = np.random.default_rng(seed)
    return np.exp(draw.uniform(np.log(low), np.log(high), count)).astype(int).tolist()


def waste(lengths, rows_per_batch) -> float:
    slots = sum(len(rows) * ROW for rows in rows_per_batch)
    return 1 - sum(lengths) / slots


def test_packed_plan_wastes_under_half_a_percent_on_log_uniform_lengths():
    lengths = log_uniform_lengths()
    batches = plan_packed(lengths, BUDGET, ROW)
    placed = sorted(i for rows in batches for row in rows for i in row)
    assert placed == list(range(len(lengths)))  # nothing dropped, nothing twice
    for rows in batches:
        assert len(rows) * ROW <= BUDGET
        assert all(sum(lengths[i] for i in row) <= ROW for row in rows)
    assert waste(lengths, batches) <= 0.005
    # the padded planner on the same lengths, for scale: its default window pads ~10%
    padded = plan_batches(lengths, BUDGET)
    slots = sum(len(b) * max(lengths[i] for i in b) for b in padded)
    assert 1 - sum(lengths) / slots > 0.05


def test_packed_plan_keeps_data_order_between_windows():
    lengths = log_uniform_lengths(count=2000, seed=1)
    windows = list(window_runs(lengths, 2 * BUDGET))
    window_of = {i: n for n, run in enumerate(windows) for i in run}
    seen = [sorted({window_of[i] for row in rows for i in row})
            for rows in plan_packed(lengths, BUDGET, ROW, sort_window=2)]
    # a batch holds one window's sequences, or those and a row carried from the one before
    assert all(len(w) == 1 or (len(w) == 2 and w[1] == w[0] + 1) for w in seen)
    assert [w[-1] for w in seen] == sorted(w[-1] for w in seen)


def test_rows_are_capped_at_the_budget_and_long_sequences_are_named():
    assert plan_packed([3, 3, 3], max_tokens=4, row_length=100) == [[[0]], [[1]], [[2]]]
    assert pack_rows([5, 3, 2, 4], 7) == [[0, 2], [3, 1]]  # longest first, first fit
    with pytest.raises(SequenceTooLong, match="row_length"):
        pack_rows([5, 9], 8)


def assert_packed_rows_give_the_padded_gradient(model: TransformerWithLMHead, *,
                                                atol: float = 1e-6, rtol: float = 1e-5) -> None:
    """Documents of mixed lengths, drawn on ``model``'s device, packed into rows of 32 give
    ``model`` the losses and gradients of the same documents as padded rows, at tiers 0 and 1
    weighted 1 and 0.5."""
    device = next(model.parameters()).device
    examples = [torch.randint(3, 90, (n,)).to(device) for n in (17, 4, 9, 30, 2, 11, 23, 6)]
    rows = pack_rows([len(e) for e in examples], row_length=32)
    assert any(len(row) > 1 for row in rows)
    schedule = TierSchedule(tiers=[0, 1], weights=[1.0, 0.5])

    def gradient(rows, max_tokens):
        runner = MicrobatchRunner(model, AdaptiveLimitsConfig(max_tokens=max_tokens).build())
        losses = tier_gradients(runner, examples, schedule, step=3, rows=rows)
        return losses, {n: p.grad.clone() for n, p in model.named_parameters()}

    padded_losses, padded = gradient(None, 64)
    packed_losses, packed = gradient(rows, 64)  # two rows of 32 per microbatch
    assert packed_losses == pytest.approx(padded_losses, rel=rtol)
    for name, grad in padded.items():
        torch.testing.assert_close(packed[name], grad, atol=atol, rtol=rtol, msg=name)


@pytest.mark.parametrize("objective", ["causal", "masked"])
def test_packed_rows_give_the_padded_gradient_at_every_tier(objective):
    config = tiny_config(is_causal=objective == "causal")
    model = (AutoregressiveModel if config.is_causal else BERTModel)(config)
    assert_packed_rows_give_the_padded_gradient(model)
