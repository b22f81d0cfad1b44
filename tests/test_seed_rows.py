"""The founding documents' features a user of them reaches for, each as the seed writes it
(issue 50; docs/seed_features.md lists every row with its home and its test)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.models import tiny_config
from torch import nn

from matformer.modeling import AutoregressiveModel, LayerConfig, Registry, registry
from matformer.modeling.attention import AttentionContext, AttentionSubmodules, CrossAttention
from matformer.modeling.batch import MaskedBatch, PackedBatch
from matformer.modeling.batching import (
    AdaptiveLimitsConfig,
    MicrobatchRunner,
    padded_tokens,
    plan_batches,
    split_microbatches,
)
from matformer.modeling.block import BiasDropoutAdd, TransformerBlock
from matformer.modeling.checkpoint import save_pretrained
from matformer.modeling.checkpoint.hf_config import from_config_dict, to_config_dict
from matformer.modeling.errors import BatchError, ConfigError, SequenceTooLong
from matformer.modeling.layer_spec import layer_spec
from matformer.modeling.spec import ModuleSpec, build_module
from matformer.modeling.training import TierSchedule, tier_gradients

ROOT = Path(__file__).resolve().parent.parent


def test_the_export_script_runs_as_the_seed_writes_it(tmp_path):
    """``python scripts/export_matformer_tiers.py --src M --tiers 1 2`` from the repository:
    the script's folder comes first on sys.path, where no module may shadow the package."""
    torch.manual_seed(0)
    source = save_pretrained(AutoregressiveModel(tiny_config()), tmp_path / "my-model")
    done = subprocess.run([sys.executable, "scripts/export_matformer_tiers.py", "--src",
                           str(source), "--tiers", "1", "2"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((source / "matformer_manifest.json").read_text())
    assert [entry["tier"] for entry in manifest["tiers"]] == [0, 1, 2]
    assert json.loads((source / "tier2" / "config.json").read_text())["intermediate_size"] == 16


def test_an_implementation_whose_underscore_check_says_no_is_not_selected(caplog):
    """The seed's spelling: a plain ``def _is_available():`` in the class body."""
    reg = Registry()

    @reg.register("mlp", "swiglu", "my_kernel", priority=100)
    class MyKernel:
        def _is_available():  # as the seed writes it: no self, no cls
            return False

    @reg.register("mlp", "swiglu", "plain", priority=0)
    class Plain:
        pass

    @reg.register("mlp", "swiglu", "raising", priority=50)
    class Raising:
        @staticmethod
        def _is_available():
            raise RuntimeError("no device")

    with caplog.at_level(logging.WARNING, logger="matformer.registry"):
        assert reg.select("mlp", "swiglu").name == "plain"
        assert reg.select("mlp", "swiglu", requested="my_kernel").name == "plain"
        assert reg.select("mlp", "swiglu", requested="raising").name == "plain"
    assert "its _is_available() check failed" in caplog.records[0].getMessage()
    assert "raised RuntimeError: no device" in caplog.records[1].getMessage()


# --- dropout, bias-dropout-add, cross-attention, layer_number (seeds 000 and 002) ---------

DROPOUTS = ("attention_dropout", "hidden_dropout", "ffn_dropout")


def model_with(**fields) -> AutoregressiveModel:
    torch.manual_seed(0)
    return AutoregressiveModel(tiny_config(**fields))


@pytest.mark.parametrize("name", DROPOUTS)
def test_each_dropout_drops_while_training_and_never_in_eval(name):
    plain, dropped = model_with(), model_with(**{name: 0.5})
    ids = torch.arange(3, 19)[None]
    with torch.no_grad():
        assert torch.equal(plain.eval()(ids), dropped.eval()(ids))  # eval: the same bits
        dropped.train()
        torch.manual_seed(1)
        first = dropped(ids)
        torch.manual_seed(2)
        assert not torch.allclose(first, dropped(ids))  # each pass draws its own mask
        torch.manual_seed(1)
        assert torch.equal(first, dropped(ids))  # and the seed decides it
    if name == "attention_dropout":  # the reference kernel drops as SDPA does
        registry.set_preferences({"attention": {"kernel": "torch"}})
        reference = model_with(attention_dropout=0.5).train()
        with torch.no_grad():
            torch.manual_seed(1)
            assert not torch.allclose(reference(ids), plain(ids))


def test_dropout_is_read_from_the_config_and_checked():
    config = tiny_config(attention_dropout=0.1, hidden_dropout=0.2, ffn_dropout=0.05)
    back = from_config_dict(to_config_dict(config))
    assert [getattr(back, n) for n in DROPOUTS] == [0.1, 0.2, 0.05]
    llama = to_config_dict(tiny_config(attention_dropout=0.1))  # Llama has this one
    assert llama["model_type"] == "llama" and llama["attention_dropout"] == 0.1
    assert to_config_dict(tiny_config(hidden_dropout=0.1))["architectures"] == [
        "MatformerForCausalLM"]  # Llama has no residual dropout: our own code runs it
    with pytest.raises(ConfigError, match=r"ffn_dropout is a probability in \[0, 1\), got 1.0"):
        tiny_config(ffn_dropout=1.0)


class HalfAdd(nn.Module):
    """A bias-dropout-add of a user's spec: residual + out / 2."""

    def __init__(self, **_):
        super().__init__()

    def forward(self, out, residual):
        return residual + out / 2


def block_of(config, **submodules) -> TransformerBlock:
    spec = layer_spec(config.default_layer, registry, config.intermediate_size)
    for name, value in submodules.items():
        setattr(spec.submodules, name, value)
    torch.manual_seed(0)
    return build_module(spec, config=config, layer_number=3)


def context_of(model_config, hidden, **extra) -> AttentionContext:
    positional = build_module(ModuleSpec(registry.get("positional", "rope")), config=model_config)
    positions = torch.arange(hidden.shape[1])[None]
    return AttentionContext(positional=positional,
                            positional_state=positional.prepare(positions, hidden.dtype),
                            causal=True, segment_ids=None, **extra)


def test_a_spec_with_its_own_bias_dropout_add_submodules():
    config = tiny_config()
    plain, halved = block_of(config), block_of(config, self_attn_bda=HalfAdd, mlp_bda=HalfAdd)
    assert isinstance(plain.self_attn_bda, BiasDropoutAdd)
    x = torch.randn(2, 5, config.hidden_size)
    context = context_of(config, x)
    with torch.no_grad():
        attn = plain.self_attn(plain.input_layernorm(x), context)
        mid = x + attn / 2
        want = mid + plain.mlp(plain.post_attention_layernorm(mid), config.intermediate_size) / 2
        assert torch.allclose(halved(x, context, config.intermediate_size), want, atol=1e-6)


def test_a_layer_spec_with_cross_attention_reads_the_encoder_states():
    config = tiny_config()
    norm = ModuleSpec(registry.get("norm", "rmsnorm"))
    cross = ModuleSpec(CrossAttention, submodules=AttentionSubmodules())
    block = block_of(config, pre_cross_attn_layernorm=norm, cross_attn=cross).eval()
    plain = block_of(config).eval()  # the same seed: the same self-attention and MLP weights
    names = {n for n, _ in block.named_parameters()}
    assert {"encoder_attn.q_proj.weight", "encoder_attn_layer_norm.weight"} <= names
    x, memory = torch.randn(2, 5, config.hidden_size), torch.randn(2, 7, config.hidden_size)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 4:] = 0
    context = context_of(config, x, encoder_states=memory, encoder_mask=mask)
    with torch.no_grad():
        a = block.encoder_attn
        h = block.self_attn_bda(block.self_attn(block.input_layernorm(x), context), x)
        q = a.q_proj(block.encoder_attn_layer_norm(h)).view(2, 5, 4, 8).transpose(1, 2)
        k = a.k_proj(memory).view(2, 7, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
        v = a.v_proj(memory).view(2, 7, 2, 8).transpose(1, 2).repeat_interleave(2, dim=1)
        scores = (q @ k.transpose(-2, -1)) / 8 ** 0.5  # (B, H, T, S)
        scores = scores.masked_fill(mask[:, None, None, :] == 0, float("-inf"))
        h = h + a.o_proj((scores.softmax(-1) @ v).transpose(1, 2).reshape(2, 5, -1))
        want = h + block.mlp(block.post_attention_layernorm(h), config.intermediate_size)
        got = block(x, context, config.intermediate_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got, plain(x, context, config.intermediate_size))
        memory[1, 4:] = 100.0  # padding of the encoder's states is never read
        torch.testing.assert_close(block(x, context, config.intermediate_size), got)
        with pytest.raises(ValueError, match="pass encoder_states"):
            block(x, context_of(config, x), config.intermediate_size)


@registry.register("hook", "depth_probe", "torch")
class DepthProbe(nn.Module):
    """A component that reads its layer number."""

    def __init__(self, config, layer_number=None, **_):
        super().__init__()
        self.layer_number = layer_number

    def forward(self, x):
        return x * (1.0 + 0.0 * self.layer_number)


def test_every_block_and_its_submodules_know_their_layer_number():
    model = model_with(num_hidden_layers=3,
                       default_layer=LayerConfig(hooks={"pre_output": "depth_probe"}))
    assert [layer.layer_number for layer in model.model.layers] == [1, 2, 3]
    assert [layer.hooks["pre_output"].layer_number for layer in model.model.layers] == [1, 2, 3]


def test_a_pretrained_model_whose_special_ids_are_not_the_datas_is_refused(tmp_path, mdat_path,
                                                                         capsys):
    """The byte tokenizer's data marks documents with bos 257 and eos 258; a checkpoint that
    says bos 1 and eos 2 would train on them as ordinary tokens."""
    from matformer.client.standalone import main

    torch.manual_seed(0)
    save_pretrained(AutoregressiveModel(tiny_config(vocab_size=260, max_position_embeddings=128,
                                                    mask_token_id=259)), tmp_path / "named")
    common = ["--data", str(mdat_path), "--steps", "1", "--batch-tokens", "256", "--seq-len",
              "128", "--tiers", "0", "--track", "none", "--no-eval"]
    with pytest.raises(SystemExit) as exited:
        main([*common, "--init", str(tmp_path / "named"), "--out", str(tmp_path / "refused")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "the model's special ids differ from those of" in err
    assert "bos_token_id 1 (the data's: 257), eos_token_id 2 (the data's: 258)" in err
    assert not (tmp_path / "refused" / "config.json").exists()
    # a new model from a config takes the data's ids, and says so where the config differs
    (tmp_path / "model.json").write_text(json.dumps(
        {"vocab_size": 260, "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4,
         "intermediate_size": 64, "max_position_embeddings": 128, "bos_token_id": 1}))
    main([*common, "--config", str(tmp_path / "model.json"), "--out", str(tmp_path / "ok")])
    trained = json.loads((tmp_path / "ok" / "config.json").read_text())
    assert [trained[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id")] == [
        256, 257, 258]
    assert "not the config's: bos_token_id 1 (the data's: 257)" in capsys.readouterr().out


# --- pad_to_multiple_of (seed 004) --------------------------------------------------------

def test_rows_are_padded_to_a_multiple_and_budgets_count_the_padding():
    rows = [torch.arange(1, 1 + n) for n in (5, 17, 9)]
    batch = MaskedBatch.from_list(rows, pad_to_multiple_of=8)
    assert batch.data.shape == (3, 24) and batch.lengths.tolist() == [5, 17, 9]
    packed = PackedBatch.from_rows(rows, [[0, 2], [1]], pad_to_multiple_of=64)
    assert packed.data.shape == (2, 64) and int(packed.tokens.sum()) == 31
    lengths = [5, 17, 9, 30, 2, 8, 64, 33]
    for batch_rows in plan_batches(lengths, 128, pad_to_multiple_of=32):
        assert len(batch_rows) * -(-max(lengths[i] for i in batch_rows) // 32) * 32 <= 128
    for micro in split_microbatches(lengths, max_tokens=96, max_examples=8, pad_to_multiple_of=16):
        assert padded_tokens([lengths[i] for i in micro], 16) <= 96
    with pytest.raises(SequenceTooLong, match=r"70 tokens \(65 padded to a multiple of 10\)"):
        plan_batches([65], 64 + 2, pad_to_multiple_of=10)
    with pytest.raises(BatchError, match="pad_to_multiple_of must be a whole number >= 1"):
        MaskedBatch.from_list(rows, pad_to_multiple_of=0)


def test_a_step_padded_to_a_multiple_trains_as_one_padded_to_the_longest():
    """The padding is masked out: the same loss and gradients, on tensors whose length is
    the multiple."""
    lengths = (23, 40, 11, 7)
    examples = [torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(n))
                for n in lengths]
    schedule = TierSchedule(tiers=[0, 1], mode="all")
    grads, seen = {}, []
    for multiple in (1, 64):
        model = model_with().train()
        model.model.register_forward_pre_hook(
            lambda module, args, multiple=multiple: seen.append((multiple, args[0].data.shape[1])))
        runner = MicrobatchRunner(model, AdaptiveLimitsConfig(
            max_tokens=128, max_examples=2, pad_to_multiple_of=multiple).build())
        losses = tier_gradients(runner, examples, schedule, step=0)
        grads[multiple] = (losses, {n: p.grad.clone() for n, p in model.named_parameters()})
    assert {width for multiple, width in seen if multiple == 64} == {64}
    assert grads[1][0] == pytest.approx(grads[64][0], rel=1e-5)
    for name, grad in grads[1][1].items():
        torch.testing.assert_close(grads[64][1][name], grad, rtol=1e-4, atol=1e-6)
