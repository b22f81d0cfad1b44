"""Any Matformer checkpoint opens in transformers: the code it needs is packed beside it.

The loading side runs in a fresh Python process, in another working directory, after the
folder the model's own modules came from has been deleted: only what the checkpoint holds
(and the installed packages) can make it work.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from support.models import tiny_config
from test_external_modules import USER_MODULE

from matformer.modeling import build_model
from matformer.modeling.checkpoint import load_pretrained, save_pretrained
from matformer.modeling.checkpoint.export import export_tiers
from matformer.modeling.checkpoint.remote_code import CONFIG_CODE, MODEL_CODE
from matformer.modeling.errors import CheckpointError
from matformer.modeling.naming import canonical_state_dict
from matformer.server.checkpoints import CheckpointStore

pytest.importorskip("transformers")

IDS = [[3, 17, 9, 44, 5, 61, 2, 8, 30, 12, 7, 1]]

# shapes transformers cannot open as a Llama, each with the user's own components in some
SHAPES = {
    "alibi_layernorm_own_ffn_and_hook": dict(default_layer={
        "positional_encoding": "alibi", "normalization": "layernorm",
        "ffn_activation": "rc_relu2", "hooks": {"pre_mlp": {"name": "rc_gate", "init": 0.25}}}),
    "learnable_gelu_post_norm_tied": dict(tie_word_embeddings=True, default_layer={
        "positional_encoding": "learnable", "ffn_activation": "gelu",
        "normalization_position": "post"}),
    "sinusoidal_geglu_own_hook": dict(default_layer={
        "positional_encoding": "sinusoidal", "ffn_activation": "geglu",
        "hooks": {"post_mlp": "rc_gate"}}),
    "masked": dict(is_causal=False, default_layer={"hooks": {"pre_output": "rc_gate"}}),
}

SLICED = {"alibi_layernorm_own_ffn_and_hook": [], "sinusoidal_geglu_own_hook": [[0, 2]]}

LOAD = textwrap.dedent("""
    import json, sys
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM
    from matformer.modeling.checkpoint import load_pretrained
    from matformer.modeling.generation import generate

    ids = torch.tensor({ids})
    results = {{}}
    for folder, causal in json.loads(sys.argv[1]):
        auto = AutoModelForCausalLM if causal else AutoModelForMaskedLM
        theirs = auto.from_pretrained(folder, trust_remote_code=True).eval()
        ours = load_pretrained(folder).eval()
        with torch.no_grad():
            results[folder] = [theirs(ids).logits.tolist(), ours(ids).tolist(),
                               type(theirs).__name__, None, None]
            if causal:  # greedy generation through transformers' generate, and ours
                results[folder][3:] = [
                    theirs.generate(ids[:, :6], max_new_tokens=4, do_sample=False,
                                    pad_token_id=0)[0].tolist(),
                    generate(ours, ids[0, :6], max_new_tokens=4, temperature=0.0).tolist()]
    print(json.dumps(results))
""").format(ids=IDS)


def _perturbed(model):
    """Trained-looking weights: the hook's gates away from their init, and so on."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model.eval()


def _load_elsewhere(tmp_path, folders):
    """Run LOAD in a fresh process whose working directory holds nothing of ours."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "hf_modules"),
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    env.pop("MATFORMER_MODULES_PATH", None)
    done = subprocess.run([sys.executable, "-c", LOAD, json.dumps(folders)], cwd=elsewhere,
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each shape saved by Matformer (and tier slices of one), its module folder deleted."""
    root = tmp_path_factory.mktemp("remote")
    modules = root / "user_modules"
    modules.mkdir()
    (modules / "rc_components.py").write_text(USER_MODULE.format(prefix="rc"))
    expected = {}
    for name, fields in SHAPES.items():
        model = _perturbed(build_model(tiny_config(external_modules_path=str(modules),
                                                   **fields)))
        save_pretrained(model, root / name)
        with torch.no_grad():
            expected[str(root / name)] = model(torch.tensor(IDS))
            if name in SLICED:  # the user's FFN reads one width: no Mix'n'Match for it
                export_tiers(root / name, [1], mix_n_match=SLICED[name])
                tiers = [1, *SLICED[name]]
                for tier, folder in zip(tiers, [f"{name}/tier1", *(
                        f"{name}/mix-" + "-".join(map(str, t)) for t in SLICED[name])],
                        strict=True):
                    expected[str(root / folder)] = model(torch.tensor(IDS), tier=tier)
        if name == "sinusoidal_geglu_own_hook":  # as the coordinator writes its rounds
            store = CheckpointStore(root / "checkpoints", model.config, tiers=[0, 1])
            store.write(3, canonical_state_dict(model))
            with torch.no_grad():
                for tier, folder in ((None, "round-3"), (1, "round-3/tier1")):
                    expected[str(root / "checkpoints" / folder)] = model(torch.tensor(IDS),
                                                                         tier=tier)
    shutil.rmtree(modules)
    return root, expected


def test_every_shape_and_slice_opens_in_transformers_as_in_matformer(saved, tmp_path):
    _, expected = saved
    folders = [(folder, not folder.endswith("masked")) for folder in expected]
    results = _load_elsewhere(tmp_path, folders)
    for folder, (theirs, ours, kind, generated, ours_generated) in results.items():
        reference = expected[folder]
        assert torch.allclose(torch.tensor(theirs), reference, atol=1e-5), folder
        assert torch.equal(torch.tensor(ours), reference), folder  # the packed modules
        assert kind == ("MatformerForMaskedLM" if folder.endswith("masked")
                        else "MatformerForCausalLM")
        assert generated == ours_generated and (generated is None) == folder.endswith("masked")


def test_the_config_names_the_code_and_the_packed_modules_relative_to_it(saved):
    root, _ = saved
    own = root / "alibi_layernorm_own_ffn_and_hook"
    config = json.loads((own / "config.json").read_text())
    assert config["auto_map"] == {
        "AutoConfig": "configuration_matformer.MatformerConfig",
        "AutoModelForCausalLM": "modeling_matformer.MatformerForCausalLM"}
    assert config["external_modules_path"] == ["rc_components.py"]
    assert sorted(p.name for p in own.glob("*.py")) == [CONFIG_CODE, MODEL_CODE,
                                                       "rc_components.py"]
    assert "from .rc_components import" in (own / MODEL_CODE).read_text()
    masked = json.loads((root / "masked" / "config.json").read_text())
    assert set(masked["auto_map"]) == {"AutoConfig", "AutoModelForMaskedLM"}
    plain = json.loads((root / "learnable_gelu_post_norm_tied" / "config.json").read_text())
    assert plain["external_modules_path"] is None  # uses none of the user's modules
    assert not (root / "learnable_gelu_post_norm_tied" / "rc_components.py").exists()
    slice_config = json.loads((root / "alibi_layernorm_own_ffn_and_hook/tier1/config.json")
                              .read_text())
    assert slice_config["external_modules_path"] == ["rc_components.py"]


def test_a_llama_shaped_model_stays_plain_llama(tmp_path):
    save_pretrained(build_model(tiny_config()), tmp_path / "llama")
    config = json.loads((tmp_path / "llama" / "config.json").read_text())
    assert config["model_type"] == "llama" and "auto_map" not in config
    assert not list((tmp_path / "llama").glob("*.py"))


def test_a_folder_path_of_this_machine_never_reaches_config_json(tmp_path):
    folder = tmp_path / "mods"
    folder.mkdir()
    (folder / "rc2_components.py").write_text(USER_MODULE.format(prefix="rc2"))
    model = build_model(tiny_config(external_modules_path=str(folder),
                                    default_layer={"hooks": {"pre_mlp": "rc2_gate"}}))
    save_pretrained(model, tmp_path / "saved")
    text = (tmp_path / "saved" / "config.json").read_text()
    assert str(tmp_path) not in text
    reloaded = load_pretrained(tmp_path / "saved")  # the original folder still exists
    assert torch.equal(reloaded(torch.tensor(IDS)), model(torch.tensor(IDS)))


def test_two_module_files_of_one_name_are_refused(tmp_path):
    from matformer.modeling import registry

    for prefix, folder in (("rc3", "a"), ("rc4", "b")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "components.py").write_text(USER_MODULE.format(prefix=prefix))
    registry.load_modules(str(tmp_path / "b"))  # rc4's gate, from another components.py
    model = build_model(tiny_config(
        external_modules_path=str(tmp_path / "a"),
        default_layer={"hooks": {"pre_mlp": "rc3_gate"}},
        layer_overrides={1: {"hooks": {"pre_mlp": "rc4_gate"}}}))
    with pytest.raises(CheckpointError, match=r"same name \(components.py\)"):
        save_pretrained(model, tmp_path / "saved")
    assert not (tmp_path / "saved").exists()


@pytest.mark.parametrize("strategy", ["sliced", "universal"])
def test_a_client_loads_a_packed_slice_through_the_manifest(saved, strategy):
    from matformer.modeling.checkpoint.loader import load_for_tier

    root, expected = saved  # the module folder is gone: the packed copies must serve
    source = root / "alibi_layernorm_own_ffn_and_hook"
    model, _ = load_for_tier(source, 1, strategy)
    tier = 1 if strategy == "universal" else None  # universal: the whole model, run at tier 1
    with torch.no_grad():
        assert torch.equal(model(torch.tensor(IDS), tier=tier), expected[f"{source}/tier1"])
