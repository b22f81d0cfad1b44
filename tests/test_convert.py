"""`matformer-convert`: a dense checkpoint with its FFN neurons sorted by importance computes
what its source computes, its prefixes hold the neurons that matter, its slices open in
transformers, and bad input is refused in one line (modeling/checkpoint/neuron_order.py)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from support.models import tiny_config

from matformer.modeling import AutoregressiveModel
from matformer.modeling.checkpoint import load_pretrained, save_pretrained
from matformer.modeling.checkpoint.files import INDEX_NAME, WEIGHTS_NAME, read_weights
from matformer.modeling.checkpoint.neuron_order import (
    Calibration,
    activation_scores,
    ffn_names,
    permute_neurons,
    weight_scores,
)
from matformer.modeling.mdat.trained_on import RECORD_NAME
from matformer.modeling.naming import canonical_state_dict
from matformer.scripts.convert import main

transformers = pytest.importorskip("transformers")

WIDTH = 64  # tiny_config's FFN: tier 1 is the first 32 neurons
SCORES = {"weights": [], "activations": ["--score", "activations", "--seq-len", "128"]}


def model(**overrides) -> AutoregressiveModel:
    """Bytes' vocabulary and 128 positions, so the default corpus calibrates it."""
    torch.manual_seed(0)
    fields = {"vocab_size": 260, "max_position_embeddings": 128, **overrides}
    return AutoregressiveModel(tiny_config(**fields)).eval()


def scaled_neurons(dense: AutoregressiveModel, scale: torch.Tensor) -> AutoregressiveModel:
    """``dense`` with neuron ``j`` of every layer's FFN output multiplied by ``scale[j]``."""
    with torch.no_grad():
        for block in dense.model.layers:
            block.mlp.down_proj.weight.mul_(scale)
    return dense


@pytest.fixture
def source(tmp_path):
    """A dense checkpoint whose neurons differ in size, in no particular order."""
    torch.manual_seed(1)
    dense = scaled_neurons(model(), torch.rand(WIDTH) * 3)
    return save_pretrained(dense, tmp_path / "dense"), dense


def ids() -> torch.Tensor:
    return torch.randint(0, 260, (2, 24), generator=torch.Generator().manual_seed(0))


def logits(dense, tier=None) -> torch.Tensor:
    with torch.no_grad():
        return dense(ids(), tier=tier)


def convert(src, out, score, mdat_path, *more) -> None:
    data = ["--data", str(mdat_path)] if score == "activations" else []
    main([str(src), str(out), *SCORES[score], *data, *more])


@pytest.mark.parametrize("score", SCORES)
def test_the_converted_model_computes_what_the_source_computes(source, tmp_path, mdat_path,
                                                               score):
    src, dense = source
    convert(src, tmp_path / "out", score, mdat_path)
    converted = load_pretrained(tmp_path / "out").eval()
    assert torch.allclose(logits(converted), logits(dense), atol=1e-5, rtol=0)
    order = json.loads((tmp_path / "out" / "config.json").read_text())["matformer_neuron_order"]
    assert order["score"] == score
    gate = ffn_names(0)[0]
    assert not torch.equal(read_weights(tmp_path / "out")[gate], read_weights(src)[gate])


def test_a_sharded_checkpoint_converts_sharded_with_its_data_record(tmp_path):
    dense = scaled_neurons(model(), torch.rand(WIDTH) * 3)
    record = {"data": "d.mdat", "strategy": "bytes128", "view": None, "seq_len": 128, "seed": 0}
    src = save_pretrained(dense, tmp_path / "dense", max_shard_bytes=20_000,
                          files={RECORD_NAME: json.dumps(record).encode()})
    main([str(src), str(tmp_path / "out")])
    assert (tmp_path / "out" / INDEX_NAME).is_file()
    assert torch.allclose(logits(load_pretrained(tmp_path / "out")), logits(dense), atol=1e-5)
    assert json.loads((tmp_path / "out" / RECORD_NAME).read_text()) == record  # same data


def test_a_hugging_face_llama_folder_converts_to_the_same_function(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=260, hidden_size=32, intermediate_size=WIDTH, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path / "hf")
    main([str(tmp_path / "hf"), str(tmp_path / "out")])
    converted = load_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        assert torch.allclose(converted(ids()), hf(ids()).logits, atol=1e-5, rtol=0)
    assert (tmp_path / "out" / "generation_config.json").is_file()  # copied as export copies


@pytest.mark.parametrize("score", SCORES)
def test_neurons_are_sorted_by_score_and_tier_one_holds_other_neurons(
        source, tmp_path, mdat_path, score):
    src, _ = source
    convert(src, tmp_path / "out", score, mdat_path)
    state = read_weights(tmp_path / "out")
    if score == "weights":
        scores = weight_scores(state, 2)
    else:
        calibration = Calibration(mdat_path, seq_len=128)
        converted = load_pretrained(tmp_path / "out")
        scores = activation_scores(converted, calibration.examples(converted.config))
    for layer, score_of in enumerate(scores):
        assert torch.all(score_of[:-1] >= score_of[1:] * (1 - 1e-5)), f"layer {layer}"
    gate = ffn_names(0)[0]
    assert not torch.equal(state[gate][:WIDTH // 2].sort(0).values,
                           read_weights(src)[gate][:WIDTH // 2].sort(0).values)


def test_a_permutation_keeps_the_ffn_with_its_biases():
    torch.manual_seed(0)
    names = [name.replace(".weight", ".bias") for name in ffn_names(0)]
    state = {ffn_names(0)[0]: torch.randn(8, 4), ffn_names(0)[1]: torch.randn(8, 4),
             ffn_names(0)[2]: torch.randn(4, 8), names[0]: torch.randn(8),
             names[1]: torch.randn(8), names[2]: torch.randn(4)}

    def ffn(s, x):
        gate, up, down = (s[n] for n in ffn_names(0))
        inner = F.silu(F.linear(x, gate, s[names[0]])) * F.linear(x, up, s[names[1]])
        return F.linear(inner, down, s[names[2]])

    order = torch.randperm(8)
    permuted = permute_neurons(state, [order])
    x = torch.randn(3, 4)
    assert torch.allclose(ffn(permuted, x), ffn(state, x), atol=1e-6)
    assert torch.equal(permuted[names[0]], state[names[0]][order])
    assert torch.equal(permuted[names[2]], state[names[2]])  # on the hidden side: kept


def test_tier_slices_written_with_the_conversion_open_in_transformers(source, tmp_path,
                                                                      mdat_path):
    src, _ = source
    convert(src, tmp_path / "out", "weights", mdat_path, "--tiers", "1", "2")
    converted = load_pretrained(tmp_path / "out").eval()
    for tier in (1, 2):
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / f"tier{tier}")
        assert hf.config.intermediate_size == WIDTH >> tier
        with torch.no_grad():
            assert torch.allclose(hf.eval()(ids()).logits, logits(converted, tier), atol=1e-5)
    assert (tmp_path / "out" / "matformer_manifest.json").is_file()


def planted(tmp_path):
    """A model whose few large neurons all sit in the second half: slicing it unordered
    cuts exactly what matters."""
    scale = torch.full((WIDTH,), 0.02)
    scale[[40, 45, 50, 55, 60, 63]] = 4.0
    dense = scaled_neurons(model(), scale)
    return save_pretrained(dense, tmp_path / "planted"), dense


@pytest.mark.parametrize("score", SCORES)
def test_the_ordered_tier_one_slice_is_closer_to_the_full_model(tmp_path, mdat_path, score):
    src, dense = planted(tmp_path)
    convert(src, tmp_path / "out", score, mdat_path)
    converted = load_pretrained(tmp_path / "out").eval()
    full = logits(dense)

    def error(m):
        return (logits(m, tier=1) - full).abs().mean().item()

    assert error(converted) < error(dense) / 10, (error(converted), error(dense))


def refusal(capsys, argv) -> str:
    with pytest.raises(SystemExit) as exited:
        main([str(a) for a in argv])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("matformer-convert: error: ") and err.count("\n") == 1, err
    return err


def test_bad_input_is_refused_in_one_line(source, tmp_path, mdat_path, capsys):
    src, _ = source
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert "exists and is not empty" in refusal(capsys, [src, tmp_path / "full"])
    assert "needs --data" in refusal(capsys, [src, tmp_path / "a", "--score", "activations"])

    gelu = save_pretrained(model(default_layer={"ffn_activation": "gelu"}), tmp_path / "gelu")
    assert "not Llama-shaped" in refusal(capsys, [gelu, tmp_path / "b"])

    no_ffn = save_pretrained(model(), tmp_path / "no_ffn")
    weights = load_file(no_ffn / WEIGHTS_NAME)
    save_file({k: v for k, v in weights.items() if ".mlp." not in k}, no_ffn / WEIGHTS_NAME)
    assert "holds no FFN weights" in refusal(capsys, [no_ffn, tmp_path / "c"])

    small = save_pretrained(model(vocab_size=96), tmp_path / "small")
    err = refusal(capsys, [small, tmp_path / "d", "--score", "activations", "--data", mdat_path,
                           "--seq-len", "128"])
    assert "vocabulary of 260 ids, more than the model's 96" in err

    assert "slices are tiers >= 1" in refusal(capsys, [src, tmp_path / "e", "--tiers", "0"])
    main([str(src), str(tmp_path / "f"), "--tiers", "1"])
    assert "tier 1 slice" in refusal(capsys, [tmp_path / "f" / "tier1", tmp_path / "g"])
    assert not any((tmp_path / name).exists() for name in "abcdeg")


def test_the_command_exits_2_with_one_line(source, tmp_path):
    src, _ = source
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    done = subprocess.run(["matformer-convert", str(src), str(tmp_path / "full")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("matformer-convert: error: ")
    assert done.stderr.count("\n") == 1 and "is not empty" in done.stderr
    assert canonical_state_dict(load_pretrained(src))  # the source is untouched, still loads
