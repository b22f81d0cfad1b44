"""Nested FFN tiers: exact gradient isolation, slices equal standalone models, Mix'n'Match."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.models import tiny_config

from matformer.modeling import AutoregressiveModel, TierError, canonical_state_dict, layer_widths
from matformer.modeling.checkpoint.slicing import slice_state
from matformer.modeling.matformer import Tier, tier_label, tier_width
from matformer.modeling.naming import load_canonical_state_dict

TIERS = [1, 2, 3]
MIXES = [[0, 1], [1, 3]]  # Mix'n'Match: a tier per layer of tiny_config's two


def sliced_twin(universal: AutoregressiveModel, tier: Tier) -> AutoregressiveModel:
    """A standalone model holding only ``universal``'s FFN neurons at ``tier`` (one tier, or
    one per layer), on ``universal``'s device, in eval mode."""
    config = universal.config
    widths = layer_widths(config, tier)
    tiers = [tier] * config.num_hidden_layers if isinstance(tier, int) else list(tier)
    sliced = AutoregressiveModel(dataclasses.replace(
        config, intermediate_size=widths[0], matformer_tier=tiers[0],
        matformer_layer_tiers=None if isinstance(tier, int) else tiers,
    ))
    load_canonical_state_dict(sliced, slice_state(canonical_state_dict(universal), widths))
    return sliced.to(next(universal.parameters()).device).eval()


def assert_tier_equals_its_slice(universal: AutoregressiveModel, ids: torch.Tensor, tier: Tier,
                                 **tolerance: float) -> None:
    """``universal`` run at ``tier`` gives the logits of the model built from its slice."""
    sliced = sliced_twin(universal, tier)
    with torch.no_grad():
        got = sliced(ids)
        torch.testing.assert_close(got, universal(ids, tier=tier), **tolerance)
    assert got.shape == (*ids.shape, universal.config.vocab_size)


def assert_ffn_tail_gets_zero_gradient(model: AutoregressiveModel, ids: torch.Tensor,
                                       tier: int) -> None:
    """A backward pass at ``tier`` gives the FFN neurons past its width exactly 0 gradient,
    and those within it some."""
    model.loss(ids, tier=tier).backward()
    width = model.config.intermediate_size >> tier
    for layer in model.model.layers:
        mlp = layer.mlp
        rows = [p for p in (getattr(mlp, "gate_proj", None), mlp.up_proj) if p is not None]
        for proj in rows:
            assert torch.count_nonzero(proj.weight.grad[width:]) == 0
            assert torch.count_nonzero(proj.weight.grad[:width]) > 0
        assert torch.count_nonzero(mlp.down_proj.weight.grad[:, width:]) == 0
        assert torch.count_nonzero(mlp.down_proj.weight.grad[:, :width]) > 0


def assert_each_layer_runs_its_own_width(model: AutoregressiveModel, ids: torch.Tensor) -> None:
    """On a 3-layer tiny model: tiers [2, 2, 2] are tier 2, and [0, 1, 2] runs (and trains)
    64, 32 and 16 neurons in layers 0, 1 and 2."""
    with torch.no_grad():
        torch.testing.assert_close(model(ids, tier=[2, 2, 2]), model(ids, tier=2))
        mixed = model(ids, tier=[0, 1, 2])
    assert not torch.allclose(mixed, model(ids, tier=0))
    model.loss(ids, tier=[0, 1, 2]).backward()
    grads = [layer.mlp.up_proj.weight.grad for layer in model.model.layers]
    assert [int(torch.count_nonzero(g.abs().sum(1))) for g in grads] == [64, 32, 16]


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu"])
@pytest.mark.parametrize("tier", TIERS)
def test_ffn_tail_gets_exactly_zero_gradient(tier, activation):
    model = AutoregressiveModel(tiny_config(default_layer={"ffn_activation": activation}))
    assert_ffn_tail_gets_zero_gradient(model, torch.randint(0, 90, (2, 12)), tier)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("tier", [0, *TIERS, *MIXES], ids=tier_label)
def test_tier_equals_standalone_model_built_from_its_slice(tier, activation):
    universal = AutoregressiveModel(tiny_config(default_layer={"ffn_activation": activation}))
    assert_tier_equals_its_slice(universal.eval(), torch.randint(0, 90, (2, 12)), tier,
                                 atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("tier", [0, 1, 2])
def test_tier_slice_matches_hugging_face_llama(tier):
    transformers = pytest.importorskip("transformers")
    config = tiny_config()
    universal = AutoregressiveModel(config).eval()
    width = config.intermediate_size >> tier
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=width, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, rms_norm_eps=config.norm_eps,
        max_position_embeddings=config.max_position_embeddings, rope_theta=config.rope_theta,
        tie_word_embeddings=False, attn_implementation="eager",
    )
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    hf.load_state_dict(slice_state(canonical_state_dict(universal), [width] * 2), strict=True)
    ids = torch.randint(0, 90, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 9:] = 0
    with torch.no_grad():
        ours = universal(ids, mask, tier=tier)
        theirs = hf(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    assert (ours[real] - theirs[real]).abs().max() <= 1e-4


def test_mix_n_match_uses_a_width_per_layer():
    config = tiny_config(num_hidden_layers=3)
    model = AutoregressiveModel(config).eval()
    assert layer_widths(config, [0, 1, 1]) == [64, 32, 32]
    assert_each_layer_runs_its_own_width(model, torch.randint(0, 90, (1, 8)))


@pytest.mark.parametrize(
    ("tier", "message"),
    [
        (7, "not a whole number >= 1"),  # 64 / 2**7 = 0.5
        (-1, "integer >= 0"),
        (1.5, "integer >= 0"),
        (True, "integer >= 0"),
        ([0, 1], "one tier per layer"),
        ([1, 0, 0], "grow wider with depth at layer 1"),
    ],
)
def test_bad_tiers_are_named_errors(tier, message):
    config = tiny_config(num_hidden_layers=3)
    with pytest.raises(TierError, match=message):
        layer_widths(config, tier)


def test_non_integer_width_names_the_deepest_tier():
    config = tiny_config(intermediate_size=96)  # 96 = 3 * 2**5
    assert tier_width(config, 5) == 3
    with pytest.raises(TierError, match=r"96/2\*\*6 = 1\.5.*deepest tier is 5"):
        tier_width(config, 6)


def test_sliced_checkpoint_cannot_run_a_larger_tier():
    config = tiny_config(intermediate_size=16, matformer_tier=2,
                         matformer_base_intermediate_size=64)
    model = AutoregressiveModel(config)
    assert layer_widths(config) == [16, 16]
    assert layer_widths(config, 3) == [8, 8]
    with pytest.raises(TierError, match="tier 2 slice"):
        model(torch.randint(0, 90, (1, 4)), tier=1)
