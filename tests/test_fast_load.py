"""Loading builds on the meta device and takes the checkpoint's tensors (issue 33): the model
it gives equals, bit for bit, a real build with the tensors copied in, as loading did before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from support.models import tiny_config
from torch import nn

from matformer.modeling import build_model, registry
from matformer.modeling.checkpoint import load_pretrained, save_pretrained
from matformer.modeling.checkpoint.export import export_tiers
from matformer.modeling.checkpoint.files import WEIGHTS_NAME, read_weights
from matformer.modeling.checkpoint.loader import load_for_tier
from matformer.modeling.checkpoint.pretrained import load_state_into
from matformer.modeling.checkpoint.slicing import slice_state
from matformer.modeling.components.positional import PositionalEncoding
from matformer.modeling.errors import ShapeMismatch
from matformer.modeling.naming import canonical_state_dict

IDS = torch.arange(3, 15)[None]


@registry.register("positional", "test_undeclared_table", "torch")
class UndeclaredTable(PositionalEncoding):
    """Adds a table it computes at build without declaring it (not ``ComputedBuffers``):
    loading must build it for real to have it."""

    def __init__(self, config, **_):
        super().__init__(config)
        length, width = config.max_position_embeddings, config.hidden_size
        table = torch.linspace(0, 1, length * width).view(length, width)
        self.register_buffer("table", table, persistent=False)

    def embed(self, x, positions):
        return x + self.table[positions]


SHAPES = {
    "llama": {},
    "tied": dict(tie_word_embeddings=True),
    "learnable+layernorm+gelu": dict(default_layer={
        "positional_encoding": "learnable", "normalization": "layernorm",
        "ffn_activation": "gelu", "hooks": {"post_mlp": {"name": "layer_scale", "init": 0.3}}}),
    "sinusoidal": dict(default_layer={"positional_encoding": "sinusoidal"}),
    "masked+alibi+tied": dict(is_causal=False, tie_word_embeddings=True, default_layer={
        "positional_encoding": "alibi", "normalization_position": "post"},
        layer_overrides={1: {"ffn_activation": "geglu"}}),
    "wersa": dict(default_layer={"attn_impl": "wersa"}),
    "undeclared buffer": dict(default_layer={"positional_encoding": "test_undeclared_table"}),
}


def saved(tmp_path: Path, name: str, dtype: torch.dtype = torch.float32) -> Path:
    torch.manual_seed(0)
    model = build_model(tiny_config(**SHAPES[name])).to(dtype)
    return save_pretrained(model, tmp_path / "m")


def copied(config, state: dict[str, torch.Tensor]) -> nn.Module:
    """The load before issue 33: a real build, every tensor copied into its own."""
    model = build_model(config)
    load_state_into(model, state, Path("checkpoint"))
    return model


def assert_equal_models(loaded: nn.Module, reference: nn.Module) -> None:
    """Same tensors (dtype and layout too), same computed buffers, same logits, bit for bit;
    nothing left on the meta device."""
    loaded.eval()
    reference.eval()
    assert type(loaded) is type(reference) and loaded.config == reference.config
    for kind in ("state_dict", "named_buffers"):
        ours, theirs = dict(getattr(loaded, kind)()), dict(getattr(reference, kind)())
        assert list(ours) == list(theirs)
        for name, tensor in ours.items():
            assert not tensor.is_meta, name
            assert tensor.dtype == theirs[name].dtype, name
            assert tensor.stride() == theirs[name].stride(), name
            assert torch.equal(tensor, theirs[name]), name
    assert [p.requires_grad for p in loaded.parameters()] == [
        p.requires_grad for p in reference.parameters()]
    with torch.no_grad():
        assert torch.equal(loaded(IDS), reference(IDS))


@pytest.mark.parametrize("name", list(SHAPES))
def test_load_pretrained_equals_a_real_build_with_the_tensors_copied_in(tmp_path, name):
    source = saved(tmp_path, name)
    loaded = load_pretrained(source)
    assert_equal_models(loaded, copied(loaded.config, read_weights(source)))
    if loaded.config.tie_word_embeddings:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
        assert len(list(loaded.parameters())) == len(set(loaded.state_dict())) - 1


def test_computed_buffers_equal_those_of_a_normal_build(tmp_path):
    for name in ("sinusoidal", "masked+alibi+tied", "wersa", "undeclared buffer"):
        config = tiny_config(**SHAPES[name])
        built = dict(build_model(config).named_buffers())
        assert built, name
        loaded = dict(load_pretrained(saved(tmp_path / name, name)).named_buffers())
        assert list(loaded) == list(built)
        for key, value in built.items():
            assert torch.equal(loaded[key], value) and loaded[key].device == value.device


@pytest.mark.parametrize("name", ["sinusoidal", "masked+alibi+tied"])
@pytest.mark.parametrize(("file_dtype", "dtype"), [
    (torch.bfloat16, None), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
    (torch.float16, torch.bfloat16), (torch.bfloat16, torch.float16)])
def test_every_dtype_the_file_holds_loads_as_the_copying_load_gave_it(tmp_path, name,
                                                                      file_dtype, dtype):
    source = saved(tmp_path, name, file_dtype)
    loaded = load_pretrained(source, dtype)
    reference = copied(loaded.config, read_weights(source))
    assert_equal_models(loaded, reference if dtype is None else reference.to(dtype))
    if loaded.config.tie_word_embeddings:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight


def test_loading_draws_nothing_from_the_global_generator(tmp_path):
    """Nothing is drawn only to be overwritten: the weights come from the file alone."""
    source = saved(tmp_path, "llama")
    torch.manual_seed(1)
    load_pretrained(source)
    after_load = torch.rand(4)
    torch.manual_seed(1)
    assert torch.equal(after_load, torch.rand(4))


@pytest.mark.skipif(not Path("/proc/self/maps").is_file(), reason="reads Linux's memory maps")
def test_the_parameters_are_the_memory_mapped_file_not_copies(tmp_path):
    source = saved(tmp_path, "llama")
    model = load_pretrained(source)
    weights = str((source / WEIGHTS_NAME).resolve())
    mapped = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *_, path = line.split(maxsplit=5)
        if path == weights:
            start, end = (int(x, 16) for x in span.split("-"))
            mapped.append((start, end))
    pointers = [p.data_ptr() for p in model.parameters()]
    assert mapped and all(any(a <= ptr < b for a, b in mapped) for ptr in pointers)


@pytest.fixture
def exported(tmp_path):
    torch.manual_seed(0)
    universal = build_model(tiny_config(default_layer={"positional_encoding": "alibi"}))
    source = save_pretrained(universal, tmp_path / "tiny", max_shard_bytes=8_000)
    export_tiers(source, [1, 2], mix_n_match=[[0, 1]])
    return source


@pytest.mark.parametrize(("tier", "strategy", "used"), [
    (0, "auto", "universal"), (1, "sliced", "sliced"), (2, "universal", "universal"),
    ([0, 1], "sliced", "sliced"), ([1, 2], "auto", "universal")])
def test_a_tier_loads_as_the_copying_loader_gave_it(exported, tier, strategy, used):
    """Slices from the files, and the universal checkpoint sliced at load (narrowed tensors,
    which the model holds as copies of their own, laid out as a real build's)."""
    model, resolved = load_for_tier(exported, tier, strategy)
    assert resolved.used == used
    widths = [layer.mlp.up_proj.weight.shape[0] for layer in model.model.layers]
    expected = slice_state(read_weights(exported), widths)
    assert_equal_models(model, copied(model.config, expected))


@pytest.mark.parametrize(("change", "error", "message"), [
    (lambda state: state.pop("model.norm.weight"),
     RuntimeError, r"Missing key\(s\).*model\.norm\.weight"),
    (lambda state: state.update({"model.norm.weight": torch.ones(31)}),
     ShapeMismatch, r"model\.norm\.weight .* shape \(31,\).*\(32,\)"),
    (lambda state: state.update({"model.extra.weight": torch.ones(3)}),
     KeyError, "no place in this model: model.extra.weight"),
], ids=["missing", "misshapen", "unknown"])
def test_a_missing_misshapen_or_unknown_tensor_is_named_as_before(tmp_path, change, error,
                                                                   message):
    source = saved(tmp_path, "llama")
    state = load_file(source / WEIGHTS_NAME)
    change(state)
    save_file(state, source / WEIGHTS_NAME)
    with pytest.raises(error, match=message):
        copied(tiny_config(), read_weights(source))
    with pytest.raises(error, match=message):
        load_pretrained(source)


def test_the_file_stays_as_it_was_and_replaceable_under_a_loaded_model(tmp_path):
    """The parameters map the file they came from, privately: changing them leaves the file
    alone, and saving anew replaces the file (a rename) without changing them."""
    source = saved(tmp_path, "llama")
    on_disk = load_file(source / WEIGHTS_NAME)
    model = load_pretrained(source)
    with torch.no_grad():
        model.model.norm.weight.add_(1)
    assert torch.equal(load_file(source / WEIGHTS_NAME)["model.norm.weight"],
                       on_disk["model.norm.weight"])
    before = {k: v.clone() for k, v in canonical_state_dict(model).items()}
    torch.manual_seed(5)
    save_pretrained(build_model(tiny_config()), source)
    assert not torch.equal(load_file(source / WEIGHTS_NAME)["lm_head.weight"],
                           before["lm_head.weight"])
    for name, value in canonical_state_dict(model).items():
        assert torch.equal(value, before[name]), name
