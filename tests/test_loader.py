"""resolve/load: strategies, manifest paths, integrity, metadata, double slicing, hub repos."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from support.models import edit_manifest, logits, tiny_config

from matformer.modeling import AutoregressiveModel
from matformer.modeling.checkpoint import save_pretrained
from matformer.modeling.checkpoint.export import export_tiers
from matformer.modeling.checkpoint.hf_config import infer_metadata
from matformer.modeling.checkpoint.loader import load_for_tier, resolve
from matformer.modeling.checkpoint.manifest import MANIFEST_NAME
from matformer.modeling.checkpoint.repository import normalize
from matformer.modeling.checkpoint.schema import canonical_schema_hash, local_schema_hash
from matformer.modeling.errors import (
    AlreadySliced,
    CheckpointError,
    ConfigError,
    IncompleteTier,
    IntegrityError,
    ManifestMissing,
    ManifestVersionError,
    PathEscapesRepository,
    TierNotInManifest,
)
from matformer.modeling.naming import canonical_names


@pytest.fixture
def exported(tmp_path, universal):
    source = save_pretrained(universal, tmp_path / "tiny", max_shard_bytes=8_000)
    (source / "tokenizer.json").write_text("{}")
    export_tiers(source, [1, 2])
    return source


def tier_file(source, tier, number):
    """The repository path of the ``number``-th weights shard of ``tier`` in the manifest."""
    files = json.loads((source / MANIFEST_NAME).read_text())["tiers"][tier]["files"]
    return normalize(files[1 + number], source.name)


@pytest.mark.parametrize(
    ("strategy", "tier", "used", "width"),
    [("auto", 1, "sliced", 32), ("sliced", 2, "sliced", 16), ("universal", 1, "universal", 64),
     ("auto", 0, "universal", 64), ("sliced", 0, "universal", 64)],
)
def test_strategies_with_manifest(exported, universal, strategy, tier, used, width):
    model, resolved = load_for_tier(exported, tier, strategy)
    assert resolved.used == used
    assert model.config.intermediate_size == width
    fetched = "\n".join(resolved.files)
    assert ("tiny/tier" in fetched) == (used == "sliced")
    assert "tokenizer.json" in fetched
    torch.testing.assert_close(logits(model, tier), logits(universal, tier))


def test_auto_falls_back_to_universal_sliced_at_load(exported, universal):
    victim = tier_file(exported, 1, 2)
    (exported.parent / victim).unlink()
    model, resolved = load_for_tier(exported, 1, "auto")
    assert resolved.used == "universal" and f"missing {victim}" in resolved.reason
    assert model.config.intermediate_size == 32 and model.config.matformer_tier == 1
    torch.testing.assert_close(logits(model), logits(universal, 1))


def test_sliced_names_missing_files(exported):
    (exported / "tier2" / "config.json").unlink()
    with pytest.raises(IncompleteTier, match=r"missing: tiny/tier2/config\.json"):
        resolve(exported, 2, "sliced")


def test_without_manifest(tmp_path, universal):
    source = save_pretrained(universal, tmp_path / "plain")
    model, resolved = load_for_tier(source, 2, "auto")
    assert resolved.used == "universal" and model.config.intermediate_size == 16
    torch.testing.assert_close(logits(model), logits(universal, 2))
    assert load_for_tier(source, 2, "universal")[0].config.intermediate_size == 64
    with pytest.raises(ManifestMissing, match=r"no matformer_manifest\.json"):
        resolve(source, 1, "sliced")


def test_tier_not_in_manifest_lists_available(exported):
    with pytest.raises(TierNotInManifest, match="lists no tier 3; available tiers: 0, 1, 2"):
        resolve(exported, 3, "sliced")
    assert resolve(exported, 3, "auto").used == "universal"


@pytest.mark.parametrize("strategy", ["auto", "sliced", "universal"])
@pytest.mark.parametrize("victim", ["tier1-shard", "tiny/config.json", "tiny/tokenizer.json"])
def test_tampered_file_is_refused_under_every_strategy(exported, strategy, victim):
    if victim == "tier1-shard":
        victim = tier_file(exported, 1, 1)
    path = exported.parent / victim
    path.write_bytes(path.read_bytes()[:-1] + b"\x00")
    touched = "tier1" not in victim or strategy != "universal"
    if touched:
        with pytest.raises(IntegrityError, match="does not match the sha256"):
            resolve(exported, 1, strategy)
    else:
        resolve(exported, 1, strategy)


def test_manifest_of_another_schema_version(exported):
    edit_manifest(exported, lambda d: d.update(schema_version=2))
    with pytest.raises(ManifestVersionError, match=r"schema_version 2.*reads version 1"):
        resolve(exported, 1, "auto")


@pytest.mark.parametrize(
    ("path", "base", "expected"),
    [("./config.json", "tiny", "tiny/config.json"),
     ("../tiny-tier1/model.safetensors", "tiny", "tiny-tier1/model.safetensors"),
     ("../../../x.json", "tiny", "x.json"),  # clamped at the root
     ("../tier1/a.json", "", "tier1/a.json"),
     ("a/./b/../c.json", "", "a/c.json")],
)
def test_manifest_paths_normalize(path, base, expected):
    assert normalize(path, base) == expected


@pytest.mark.parametrize("path", ["", "  ", "/etc/passwd", "\\\\server\\x", "C:\\model", "./"])
def test_bad_manifest_paths_are_rejected(path):
    with pytest.raises(PathEscapesRepository):
        normalize(path, "tiny")


def test_symlink_out_of_the_repository_is_refused(exported, tmp_path_factory):
    outside = tmp_path_factory.mktemp("elsewhere") / "model.safetensors"
    target = exported.parent / tier_file(exported, 1, 1)
    shutil.copy(target, outside)
    target.unlink()
    target.symlink_to(outside)
    with pytest.raises(PathEscapesRepository, match="outside the repository"):
        resolve(exported, 1, "sliced")


@pytest.mark.parametrize(
    ("data", "tier", "base", "expected"),
    [({"intermediate_size": 16}, 2, 64, (2, 64)),  # from the manifest entry
     ({"intermediate_size": 16}, None, 64, (2, 64)),  # from the sizes
     ({"intermediate_size": 64}, None, None, (0, None)),
     ({"intermediate_size": 16, "matformer_tier": 2}, None, 64, (2, 64))],
)
def test_metadata_inference(data, tier, base, expected):
    out = infer_metadata(data, tier=tier, base=base)
    assert (out["matformer_tier"], out.get("matformer_base_intermediate_size")) == expected


def test_metadata_inference_refuses_non_power_of_two():
    with pytest.raises(ConfigError, match="not base 64 / 2\\*\\*t"):
        infer_metadata({"intermediate_size": 24}, tier=None, base=64)


def test_slice_without_metadata_gets_it_from_the_manifest(exported, universal):
    config_path = exported / "tier1" / "config.json"
    data = json.loads(config_path.read_text())
    del data["matformer_tier"], data["matformer_base_intermediate_size"]
    config_path.write_text(json.dumps(data))
    edit_manifest(exported, lambda d: d["sha256"].pop("tier1/config.json"))
    model, _ = load_for_tier(exported, 1, "sliced")
    assert (model.config.matformer_tier, model.config.matformer_base_intermediate_size) == (1, 64)


def test_a_slice_is_never_sliced_again(exported, universal):
    slice_dir = exported / "tier1"
    for strategy in ("auto", "sliced"):
        model, resolved = load_for_tier(slice_dir, 1, strategy)
        assert resolved.used == "sliced" and "already the tier 1 slice" in resolved.reason
        assert model.config.intermediate_size == 32
        torch.testing.assert_close(logits(model), logits(universal, 1))
    # tier 2 on the tier-1 slice narrows from the base width: 16 neurons, not 32/4
    model, _ = load_for_tier(slice_dir, 2, "auto")
    torch.testing.assert_close(logits(model, 2), logits(universal, 2))
    with pytest.raises(AlreadySliced, match="tier 1 slice, not a universal"):
        resolve(slice_dir, 1, "universal")


def test_hub_repository_fetches_only_the_tier(exported, universal, tmp_path, monkeypatch):
    """A hub cache laid out like a downloaded repo, offline: tier 1 needs no universal weights."""
    cache = tmp_path / "hub"
    snapshot = cache / "models--org--tiny" / "snapshots" / "0123abcd"
    (cache / "models--org--tiny" / "refs").mkdir(parents=True)
    (cache / "models--org--tiny" / "refs" / "main").write_text("0123abcd")
    snapshot.mkdir(parents=True)
    for name in (MANIFEST_NAME, "config.json", "tokenizer.json"):
        shutil.copy(exported / name, snapshot / name)
    shutil.copytree(exported / "tier1", snapshot / "tier1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)

    model, resolved = load_for_tier("org/tiny", 1, "auto", cache_dir=cache)
    assert resolved.used == "sliced"
    listed = json.loads((exported / MANIFEST_NAME).read_text())["tiers"][1]["files"]
    assert sorted(resolved.files) == sorted(
        [normalize(f) for f in listed] + ["tokenizer.json"])
    torch.testing.assert_close(logits(model), logits(universal, 1))
    with pytest.raises(CheckpointError, match="missing"):
        resolve("org/tiny", 2, "auto", cache_dir=cache)


def test_unknown_source_and_strategy():
    with pytest.raises(CheckpointError, match="neither a checkpoint folder nor a hub repo id"):
        resolve("/no/such/folder", 1)
    with pytest.raises(ConfigError, match="not one of auto, sliced, universal"):
        resolve("org/x", 1, "fast")


def test_canonical_hash_is_shared_by_slices_only(exported, universal):
    hashes = {}
    for tier in (0, 1, 2):
        model, _ = load_for_tier(exported, tier, "sliced" if tier else "universal")
        names = canonical_names(model).values()
        hashes[tier] = (local_schema_hash(model.config, names),
                        canonical_schema_hash(model.config, names))
    assert len({local for local, _ in hashes.values()}) == 3
    assert len({canonical for _, canonical in hashes.values()}) == 1
    other = AutoregressiveModel(tiny_config(num_key_value_heads=4))
    assert canonical_schema_hash(other.config, canonical_names(other).values()) != hashes[0][1]
    gelu = AutoregressiveModel(tiny_config(default_layer={"ffn_activation": "gelu"}))
    assert canonical_schema_hash(gelu.config, canonical_names(gelu).values()) != hashes[0][1]


def test_mix_n_match_export_and_load(tmp_path, universal):
    source = save_pretrained(universal, tmp_path / "tiny")
    export_tiers(source, [1], mix_n_match=[[0, 1], [1, 2]])
    manifest = json.loads((source / MANIFEST_NAME).read_text())
    assert [e["tier"] for e in manifest["tiers"]] == [0, 1]  # integers only (schema v1)
    mix = next(e for e in manifest["mix_n_match"] if e["layer_tiers"] == [0, 1])
    assert mix["intermediate_size"] == 64 and "tier" not in mix
    assert mix["files"][0] == "mix-0-1/config.json"
    config = json.loads((source / "mix-0-1" / "config.json").read_text())
    assert config["model_type"] == "matformer" and config["matformer_layer_tiers"] == [0, 1]

    for tiers in ([0, 1], [1, 2]):
        model, resolved = load_for_tier(source, tiers, "sliced")
        assert resolved.used == "sliced"
        shapes = [layer.mlp.up_proj.weight.shape[0] for layer in model.model.layers]
        assert shapes == [64 >> t for t in tiers]
        torch.testing.assert_close(logits(model), logits(universal, tiers))
    # a list the manifest lacks: auto slices the universal checkpoint per layer
    model, resolved = load_for_tier(source, [0, 2], "auto")
    assert resolved.used == "universal" and model.config.matformer_layer_tiers == [0, 2]
    torch.testing.assert_close(logits(model), logits(universal, [0, 2]))
    with pytest.raises(TierNotInManifest, match="no tier mix:0,2; available tiers: 0, 1, mix:0,1"):
        resolve(source, [0, 2], "sliced")


def test_mix_n_match_export_refuses_widening_lists(tmp_path, universal):
    from matformer.modeling import TierError

    source = save_pretrained(universal, tmp_path / "tiny")
    with pytest.raises(TierError, match="grow wider with depth"):
        export_tiers(source, [], mix_n_match=[[1, 0]])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]


def test_a_mix_n_match_slice_is_not_taken_for_universal(tmp_path, universal):
    source = save_pretrained(universal, tmp_path / "tiny")
    export_tiers(source, [], mix_n_match=[[0, 1]])
    with pytest.raises(AlreadySliced, match="tier mix:0,1 slice"):
        resolve(source / "mix-0-1", 0, "universal")
    model, resolved = load_for_tier(source / "mix-0-1", [0, 1], "auto")
    assert resolved.used == "sliced"
    torch.testing.assert_close(logits(model), logits(universal, [0, 1]))
