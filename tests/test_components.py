"""Every positional encoding × norm × norm position × activation builds and trains."""

from __future__ import annotations

import itertools

import pytest
import torch
from support.models import tiny_config

from matformer.modeling import AutoregressiveModel, BERTModel, registry

POSITIONAL = registry.variants("positional")
NORMS = registry.variants("norm")
POSITIONS = registry.variants("block")
ACTIVATIONS = registry.variants("mlp")


@pytest.mark.parametrize(
    ("positional", "norm", "position", "activation"),
    list(itertools.product(POSITIONAL, NORMS, POSITIONS, ACTIVATIONS)),
)
def test_combination_trains_one_step(positional, norm, position, activation):
    config = tiny_config(default_layer={
        "positional_encoding": positional, "normalization": norm,
        "normalization_position": position, "ffn_activation": activation,
    })
    model = AutoregressiveModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, config.vocab_size, (2, 16))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    loss = model.loss(ids)
    assert torch.isfinite(loss)
    loss.backward()
    optimizer.step()
    for name, param in model.named_parameters():
        assert torch.isfinite(param.grad).all(), name
        assert not torch.equal(param, before[name]), f"{name} did not train"
    assert torch.isfinite(model.loss(ids))


def test_post_norm_has_no_final_norm_and_pre_norm_has_one():
    pre = AutoregressiveModel(tiny_config())
    post = AutoregressiveModel(tiny_config(default_layer={"normalization_position": "post"}))
    assert "model.norm.weight" in pre.state_dict()
    assert not any(key.startswith("model.norm.") for key in post.state_dict())


def test_positional_parameters_follow_the_encoding():
    keys = {
        name: set(AutoregressiveModel(tiny_config(
            default_layer={"positional_encoding": name})).state_dict())
        for name in POSITIONAL
    }
    assert "model.embed_positions.weight" in keys["learnable"]
    for name in ("rope", "alibi", "sinusoidal", "nope"):
        assert keys[name] == keys["nope"], f"{name} should add no saved tensors"


@pytest.mark.parametrize("positional", POSITIONAL)
def test_order_matters_except_without_positions(positional):
    """Swapping two earlier tokens changes the last logits unless the encoding is NoPE
    in a bidirectional model (attention is then permutation-invariant)."""
    config = tiny_config(is_causal=False, default_layer={"positional_encoding": positional})
    model = BERTModel(config).eval()
    ids = torch.randint(3, 90, (1, 8))
    swapped = ids.clone()
    swapped[0, [1, 2]] = ids[0, [2, 1]]
    with torch.no_grad():
        same = torch.allclose(model(ids)[0, -1], model(swapped)[0, -1], atol=1e-6)
    assert same == (positional == "nope")


def test_grouped_query_attention_shapes():
    model = AutoregressiveModel(tiny_config(num_attention_heads=4, num_key_value_heads=1))
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (32, 32)
    assert attn.k_proj.weight.shape == (8, 32) and attn.v_proj.weight.shape == (8, 32)


def test_weight_tying_shares_one_tensor():
    model = AutoregressiveModel(tiny_config(tie_word_embeddings=True))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.loss(torch.randint(0, 90, (2, 8))).backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    optimizer.step()
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_causal_model_does_not_look_ahead():
    model = AutoregressiveModel(tiny_config()).eval()
    ids = torch.randint(0, 90, (1, 10))
    changed = ids.clone()
    changed[0, 6:] = (ids[0, 6:] + 1) % 90
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[0, :6], model(changed)[0, :6])


def test_padding_does_not_change_real_tokens():
    """A right-padded sequence gives the same logits as the sequence alone (Matchbox check)."""
    model = AutoregressiveModel(tiny_config()).eval()
    short = torch.randint(3, 90, (1, 6))
    batch = torch.cat([torch.cat([short, torch.zeros(1, 4, dtype=torch.long)], 1),
                       torch.randint(3, 90, (1, 10))])
    mask = torch.ones(2, 10, dtype=torch.long)
    mask[0, 6:] = 0
    with torch.no_grad():
        torch.testing.assert_close(model(batch, mask)[0, :6], model(short)[0], atol=1e-5,
                                   rtol=1e-5)


def test_bert_masks_only_real_tokens_at_the_configured_rate():
    config = tiny_config(is_causal=False, masked_substitution_rate=0.25)
    model = BERTModel(config)
    ids = torch.randint(3, 90, (64, 64))
    mask = torch.ones_like(ids)
    mask[:, 48:] = 0
    masked, labels = model.mask_tokens(ids, mask, torch.Generator().manual_seed(0))
    chosen = labels != -100
    assert (masked[chosen] == config.mask_token_id).all()
    assert torch.equal(masked[~chosen], ids[~chosen])
    assert not chosen[:, 48:].any()
    assert abs(chosen[:, :48].float().mean().item() - 0.25) < 0.02
    loss = model.loss(ids, mask, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(loss)


def test_a_model_built_on_the_meta_device_draws_nothing_and_imports_no_compiler():
    """Every server, client and benchmark builds the model on the meta device for its shapes;
    drawing initial values there imported torch._dynamo, some 2 s of CPU per process."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from modeling import ModelConfig, build_model\n"
            "with torch.device('meta'):\n"
            "    model = build_model(ModelConfig(hidden_size=32, num_hidden_layers=2,\n"
            "        num_attention_heads=2, num_key_value_heads=1, intermediate_size=64))\n"
            "assert all(p.is_meta for p in model.parameters())\n"
            "print('torch._dynamo' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
