"""Shared fixtures: tiny configs that build in milliseconds, and a clean registry state."""

from __future__ import annotations

import os

import pytest
import torch

from modeling import ModelConfig, registry


def tiny_config(**overrides) -> ModelConfig:
    """A 2-layer Llama-shaped model small enough for exhaustive tests."""
    fields = dict(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, max_position_embeddings=64,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, mask_token_id=95,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


@pytest.fixture(autouse=True)
def _clean_registry_state(monkeypatch):
    """No test sees another's preferences or MATFORMER_* environment overrides."""
    for key in list(os.environ):
        if key.startswith("MATFORMER_"):
            monkeypatch.delenv(key)
    registry.clear_preferences()
    torch.manual_seed(0)
    yield
    registry.clear_preferences()
