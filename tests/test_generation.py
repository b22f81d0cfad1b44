"""Generation at a tier: the KV cache gives the tokens recomputing everything gives."""

from __future__ import annotations

import logging

import pytest
import torch
from support.models import bpe_mdat, tiny_config

from matformer.modeling import AutoregressiveModel, BERTModel
from matformer.modeling.errors import ConfigError
from matformer.modeling.generation import generate


@pytest.mark.parametrize("positional", ["rope", "learnable", "sinusoidal", "nope"])
@pytest.mark.parametrize("tier", [0, 2, [0, 1]])
def test_greedy_generation_with_the_cache_equals_without(positional, tier):
    torch.manual_seed(0)
    model = AutoregressiveModel(tiny_config(default_layer={"positional_encoding": positional}))
    prompt = torch.randint(3, 90, (7,))
    cached = generate(model, prompt, tier=tier, max_new_tokens=20, temperature=0)
    recomputed = generate(model, prompt, tier=tier, max_new_tokens=20, temperature=0,
                          use_cache=False)
    assert torch.equal(cached, recomputed)
    assert torch.equal(cached[:7], prompt) and len(cached) == 27


def test_sampling_is_reproducible_and_top_k_1_is_greedy():
    model = AutoregressiveModel(tiny_config())
    prompt = torch.randint(3, 90, (5,))

    def sample(seed, **kwargs):
        return generate(model, prompt, max_new_tokens=15, temperature=1.0,
                        generator=torch.Generator().manual_seed(seed), **kwargs)

    assert torch.equal(sample(1, top_p=0.9), sample(1, top_p=0.9))
    assert not torch.equal(sample(1), sample(2))
    greedy = generate(model, prompt, max_new_tokens=15, temperature=0)
    assert torch.equal(sample(3, top_k=1), greedy)
    assert torch.equal(sample(4, top_p=1e-6), greedy)  # the nucleus is the top token alone


def test_generation_stops_at_eos_and_at_the_models_positions():
    model = AutoregressiveModel(tiny_config())  # 64 positions
    prompt = torch.randint(3, 90, (60,))
    assert len(generate(model, prompt, max_new_tokens=50, temperature=0)) == 64
    first = generate(model, prompt[:5], max_new_tokens=1, temperature=0)[-1].item()
    stopped = generate(model, prompt[:5], max_new_tokens=30, temperature=0,
                       eos_token_id=first)
    assert len(stopped) == 6


def test_alibi_generates_without_the_cache_and_says_so(caplog):
    model = AutoregressiveModel(tiny_config(default_layer={"positional_encoding": "alibi"}))
    prompt = torch.randint(3, 90, (6,))
    with caplog.at_level(logging.WARNING):
        ids = generate(model, prompt, max_new_tokens=5, temperature=0)
    assert len(ids) == 11 and "without the KV cache" in caplog.text


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_p=0.0), "top_p in"),
    (dict(top_k=0), "top_k >= 1"),
])
def test_bad_sampling_settings_are_named(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        generate(AutoregressiveModel(tiny_config()), torch.tensor([5, 6]), **kwargs)


def test_a_masked_model_does_not_generate():
    with pytest.raises(ConfigError, match="needs a causal model"):
        generate(BERTModel(tiny_config(is_causal=False)), torch.tensor([5, 6]))


def test_the_command_writes_the_same_greedy_text_with_and_without_the_cache(tmp_path, capsys):
    from matformer.modeling.checkpoint import save_pretrained
    from matformer.modeling.checkpoint.export import export_tiers
    from matformer.scripts.generate import main

    torch.manual_seed(0)
    save_pretrained(AutoregressiveModel(tiny_config(vocab_size=260, mask_token_id=259)),
                    tmp_path / "model")
    outputs = []
    for extra in ([], ["--no-cache"]):
        main([str(tmp_path / "model"), "--tier", "1", "--prompt", "def f(x):",
              "--temperature", "0", "--max-new-tokens", "12", *extra])
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].startswith("def f(x):")
    export_tiers(tmp_path / "model", [1])  # a slice runs at its own tier unasked
    main([str(tmp_path / "model" / "tier1"), "--prompt", "def f(x):", "--temperature", "0",
          "--max-new-tokens", "12"])
    assert capsys.readouterr().out == outputs[0]
    with pytest.raises(SystemExit) as exit_info:
        main([str(tmp_path / "model"), "--prompt", "x", "--tokenizer", "missing.json"])
    assert exit_info.value.code == 2
    assert "tokenizer file missing.json does not exist" in capsys.readouterr().err


def test_the_command_takes_the_tokenizer_of_the_models_mdat_strategy(tmp_path, capsys):
    from matformer.modeling.checkpoint import save_pretrained
    from matformer.modeling.mdat import build_default_mdat
    from matformer.scripts.generate import main

    build_default_mdat(tmp_path / "docs.mdat", limit=20).close()
    torch.manual_seed(0)
    save_pretrained(AutoregressiveModel(tiny_config(vocab_size=260, mask_token_id=259)),
                    tmp_path / "bytes-model")
    runs = []
    for extra in ([], ["--data", str(tmp_path / "docs.mdat")]):  # the default strategy: bytes
        main([str(tmp_path / "bytes-model"), "--prompt", "x = ", "--temperature", "0",
              "--max-new-tokens", "8", *extra])
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1]

    texts = ["def read(path): return open(path).read()", "the value of x is returned"] * 20
    vocab = bpe_mdat(tmp_path, texts, 90, pretokenize=False).get_vocab_size()
    save_pretrained(AutoregressiveModel(tiny_config(vocab_size=vocab, mask_token_id=None,
                                                    pad_token_id=0, bos_token_id=None,
                                                    eos_token_id=None)), tmp_path / "bpe-model")
    (tmp_path / "tokenizer.json").unlink()  # the container keeps its own copy
    main([str(tmp_path / "bpe-model"), "--prompt", "def read", "--data",
          str(tmp_path / "bpe.mdat"), "--strategy", "bpe", "--temperature", "0",
          "--max-new-tokens", "6"])
    out = capsys.readouterr().out
    assert out.startswith("def read") and len(out.strip()) > len("def read")
