"""The capability probe on CPU: plausible values, a positive speed, weights untouched."""

from __future__ import annotations

import torch
from conftest import tiny_config

from client.probe import memory_bytes, probe
from modeling import AutoregressiveModel


def test_probe_reports_a_plausible_cpu_and_a_positive_speed():
    model = AutoregressiveModel(tiny_config())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    found = probe(model, tier=1, sequence_length=32, batch_tokens=128, steps=2)
    assert found.device_kind == "cpu" and found.device_name
    assert 2**20 < found.memory_bytes < 2**50
    assert found.tokens_per_second > 0 and found.tier == 1
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_memory_of_the_cpu_is_what_is_available_now():
    assert memory_bytes(torch.device("cpu")) > 0
