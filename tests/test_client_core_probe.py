"""The capability probe on CPU: plausible values, a positive speed, weights untouched."""

from __future__ import annotations

import torch
from support.models import tiny_config

from matformer.client.probe import device_name, measure_tokens_per_second, memory_bytes
from matformer.modeling import AutoregressiveModel


def test_the_probe_reports_a_plausible_cpu_and_a_positive_speed():
    model = AutoregressiveModel(tiny_config())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cpu = torch.device("cpu")
    assert device_name(cpu) and 2**20 < memory_bytes(cpu) < 2**50
    speed = measure_tokens_per_second(model, 1, sequence_length=32, batch_tokens=128, steps=2)
    assert speed > 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())
