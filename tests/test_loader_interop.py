"""What the loader accepts from other writers (psyche-elastic's schema, sibling folders,
configs without metadata) and what it refuses (entries that list no weights or config).

Each test here names the item of issue 14 it pins down.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from support.models import edit_manifest, logits, tiny_config

from matformer.modeling import AutoregressiveModel
from matformer.modeling.checkpoint import save_pretrained
from matformer.modeling.checkpoint.export import export_tiers, read_manifest
from matformer.modeling.checkpoint.files import INDEX_NAME, WEIGHTS_NAME, read_weights
from matformer.modeling.checkpoint.hf_config import from_config_dict, infer_metadata
from matformer.modeling.checkpoint.loader import load_for_tier, resolve
from matformer.modeling.checkpoint.manifest import MANIFEST_NAME, Manifest
from matformer.modeling.errors import (
    CheckpointError,
    ConfigError,
    IncompleteTier,
    ManifestError,
    ManifestMissing,
    SliceMismatch,
)
from matformer.scripts.export_matformer_tiers import main as export_main


@pytest.fixture
def exported(tmp_path, universal):
    """As test_loader's, but with single-file weights."""
    source = save_pretrained(universal, tmp_path / "tiny")
    (source / "tokenizer.json").write_text("{}")
    export_tiers(source, [1, 2])
    return source


def tamper(path):
    """Change one tensor of a safetensors file, keeping it loadable."""
    from safetensors.torch import load_file, save_file

    state = load_file(path)
    name = next(n for n in state if "up_proj" in n)
    state[name] = state[name] + 1.0
    save_file(state, path, metadata={"format": "pt"})


def keep_files(tier, keep):
    def change(data):
        entry = next(e for e in data["tiers"] if e["tier"] == tier)
        entry["files"] = [f for f in entry["files"] if keep(f)]
    return change


# -- 1. an entry that lists no weights is never read from its folder ----------------------


def test_entry_listing_no_weights_is_refused_not_read_from_the_folder(exported, universal):
    tier1 = exported / "tier1" / WEIGHTS_NAME
    tamper(tier1)  # the manifest still holds the sha256 of the file as exported
    edit_manifest(exported, keep_files(1, lambda f: f.endswith("config.json")))
    with pytest.raises(IncompleteTier, match="entry for tier 1 lists no weights"):
        resolve(exported, 1, "sliced")
    model, resolved = load_for_tier(exported, 1, "auto")
    assert resolved.used == "universal" and "lists no weights" in resolved.reason
    torch.testing.assert_close(logits(model), logits(universal, 1))  # not the tampered file


def test_only_the_listed_weights_are_read(tmp_path, universal):
    """A folder holding model.safetensors and a stray index with shards: the listed file is
    what loads, though a plain folder read would prefer the index."""
    source = save_pretrained(universal, tmp_path / "tiny")
    export_tiers(source, [1])
    other = save_pretrained(AutoregressiveModel(tiny_config(intermediate_size=32)),
                            tmp_path / "other", max_shard_bytes=8_000)
    for stray in other.glob("model*"):
        shutil.copy(stray, source / "tier1" / stray.name)
    model, resolved = load_for_tier(source, 1, "sliced")
    assert resolved.weights == [WEIGHTS_NAME]
    torch.testing.assert_close(logits(model), logits(universal, 1))
    shards = sorted(p.name for p in other.glob("model-*.safetensors"))
    assert len(shards) > 1
    with pytest.raises(CheckpointError, match="outside the files to read"):
        read_weights(other, [INDEX_NAME, shards[0]])


def test_index_naming_an_unlisted_shard_is_incomplete(tmp_path, universal):
    source = save_pretrained(universal, tmp_path / "tiny", max_shard_bytes=8_000)
    export_tiers(source, [1])
    files = json.loads((source / MANIFEST_NAME).read_text())["tiers"][1]["files"]
    last = sorted(f for f in files if "-of-" in f)[-1]
    edit_manifest(source, keep_files(1, lambda f: f != last))
    with pytest.raises(IncompleteTier, match="names shards the manifest does not list"):
        resolve(source, 1, "sliced")
    assert resolve(source, 1, "auto").used == "universal"
    edit_manifest(source, keep_files(1, lambda f: not f.endswith(INDEX_NAME)))
    with pytest.raises(IncompleteTier, match="lists shards without their"):
        resolve(source, 1, "sliced")


# -- 3. an entry without config.json: a named error under sliced, a fallback under auto ------


def test_entry_without_config_json(exported, universal):
    edit_manifest(exported, keep_files(2, lambda f: not f.endswith("config.json")))
    with pytest.raises(IncompleteTier, match=r"entry for tier 2 lists no config\.json"):
        resolve(exported, 2, "sliced")
    model, resolved = load_for_tier(exported, 2, "auto")
    assert resolved.used == "universal" and "lists no config.json" in resolved.reason
    torch.testing.assert_close(logits(model), logits(universal, 2))


def test_universal_entry_without_weights_is_an_error(exported):
    edit_manifest(exported, keep_files(0, lambda f: f == "config.json"))
    for strategy in ("auto", "universal"):
        with pytest.raises(IncompleteTier, match="entry for tier 0 lists no weights"):
            resolve(exported, 0, strategy)


# -- 4. Mix'n'Match entries stay out of the integer-only ``tiers`` list -----------------------


def psyche_tiers(data):
    """What psyche-elastic's serde schema v1 reads: ``tier`` a u8, ``intermediate_size`` an
    optional integer, ``files`` strings; unknown keys ignored."""
    assert data["schema_version"] == 1
    tiers = {}
    for entry in data.get("tiers", []):
        assert type(entry["tier"]) is int and 0 <= entry["tier"] < 256, entry
        width = entry.get("intermediate_size")
        assert width is None or type(width) is int
        assert all(type(f) is str for f in entry.get("files", []))
        tiers[entry["tier"]] = entry
    return tiers


def test_mix_n_match_entries_keep_schema_v1_readable(tmp_path, universal):
    source = save_pretrained(universal, tmp_path / "tiny")
    export_tiers(source, [1, 2], mix_n_match=[[0, 1]])
    data = json.loads((source / MANIFEST_NAME).read_text())
    assert sorted(psyche_tiers(data)) == [0, 1, 2]
    assert data["mix_n_match"] == [{"layer_tiers": [0, 1], "intermediate_size": 64,
                                    "files": ["mix-0-1/config.json",
                                              "mix-0-1/model.safetensors"]}]
    assert Manifest.from_dict(data).available_tiers() == ["0", "1", "2", "mix:0,1"]


def test_manifest_from_before_the_mix_n_match_key_still_reads(tmp_path, universal):
    source = save_pretrained(universal, tmp_path / "tiny")
    export_tiers(source, [], mix_n_match=[[0, 1]])

    def old_layout(data):
        mix = data.pop("mix_n_match")[0]
        data["tiers"].append({"tier": "mix:0,1", **mix})
    edit_manifest(source, old_layout)
    model, resolved = load_for_tier(source, [0, 1], "sliced")
    assert resolved.used == "sliced"
    torch.testing.assert_close(logits(model), logits(universal, [0, 1]))


@pytest.mark.parametrize("bad", [{"tiers": [{"tier": "one", "files": []}]},
                                 {"tiers": [{"tier": -1, "files": []}]},
                                 {"tiers": {"tier": 1}},
                                 {"mix_n_match": [{"layer_tiers": [], "files": []}]},
                                 {"tiers": [{"tier": 1, "files": "a"}]},
                                 {"sha256": ["x"]}])
def test_malformed_manifests_are_named(bad):
    with pytest.raises(ManifestError, match="malformed"):
        Manifest.from_dict({"schema_version": 1, **bad})


# -- 5. the export shares tokenizer, generation config and code only --------------------------


def test_export_shares_only_what_a_tier_needs(tmp_path, universal, caplog, capsys):
    source = save_pretrained(universal, tmp_path / "tiny")
    shared = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json", "modeling_extra.py", "pkg/layers.py"]
    left = ["training_state.safetensors", "training_state.json", "README.md"]
    unseen = ["logs/metrics.jsonl", "checkpoints/step-4/config.json",
              "checkpoints/step-4/code/modeling_old.py"]  # a run's logs and checkpoints
    for name in shared + left + unseen:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        (source / name).write_text("{}")
    (source / ".cache").mkdir()
    (source / ".cache" / "lock").write_text("")
    with caplog.at_level(logging.WARNING, logger="matformer.checkpoint"):
        export_main(["--src", str(source), "--tiers", "1"])
    manifest = read_manifest(source)
    assert manifest.common_files == sorted(shared)
    tier1 = source / "tier1"
    assert sorted(p.relative_to(tier1).as_posix() for p in tier1.rglob("*") if p.is_file()) == \
        sorted(["config.json", WEIGHTS_NAME, *shared])
    assert all(not any(name in f for f in manifest.sha256) for name in left + unseen)
    assert "left out of the tier slices" in caplog.text
    assert all(name in caplog.text for name in left) and ".cache" not in caplog.text
    assert not any(name in caplog.text for name in unseen)


# -- 6. psyche's optional widths --------------------------------------------------------------


def test_manifest_without_widths_loads(exported, universal):
    def strip(data):
        del data["matformer_base_intermediate_size"]
        for entry in data["tiers"]:
            del entry["intermediate_size"]
    edit_manifest(exported, strip)
    manifest = read_manifest(exported)
    assert manifest.base_intermediate_size is None  # no entry says a width
    assert [e.intermediate_size for e in manifest.tiers] == [None, None, None]
    model, resolved = load_for_tier(exported, 2, "sliced")
    assert resolved.used == "sliced" and model.config.matformer_base_intermediate_size == 64
    torch.testing.assert_close(logits(model), logits(universal, 2))


def test_base_width_follows_from_any_entry(exported):
    edit_manifest(exported, lambda d: d.pop("matformer_base_intermediate_size"))
    manifest = read_manifest(exported)
    assert manifest.base_intermediate_size == 64
    edit_manifest(exported, lambda d: [e.pop("intermediate_size") for e in d["tiers"]
                                       if e["tier"] != 1])
    assert [e.intermediate_size for e in read_manifest(exported).tiers] == [64, 32, 16]


# -- 7. the tier inferred from the base width --------------------------------------------------


def test_config_with_base_width_but_no_tier(exported, universal):
    config_path = exported / "tier2" / "config.json"
    data = json.loads(config_path.read_text())
    del data["matformer_tier"]
    assert from_config_dict(data).matformer_tier == 2
    config_path.write_text(json.dumps(data))
    lone = shutil.move(exported / "tier2", exported.parent / "lone")
    shutil.rmtree(exported)  # no manifest hint: the folder alone says what it is
    model, resolved = load_for_tier(lone, 2, "auto")
    assert "already the tier 2 slice" in resolved.reason
    torch.testing.assert_close(logits(model), logits(universal, 2))


@pytest.mark.parametrize("width", [24, 128, 0])
def test_widths_that_are_no_tier_are_refused(width):
    with pytest.raises(ConfigError, match="not base 64 / 2"):
        infer_metadata({"intermediate_size": width, "matformer_base_intermediate_size": 64},
                       tier=None, base=None)


# -- 8. slices without a manifest: inside the universal folder, or beside it (psyche) ---------


def as_siblings(source):
    """psyche-elastic's layout: the slices beside the universal folder, no manifest."""
    (source / MANIFEST_NAME).unlink(missing_ok=True)
    for folder in [p for p in source.iterdir() if p.is_dir()]:
        folder.rename(source.parent / f"{source.name}-{folder.name}")


@pytest.mark.parametrize("layout", ["inside", "beside"])
@pytest.mark.parametrize("strategy", ["auto", "sliced"])
def test_slice_folder_without_manifest(exported, universal, strategy, layout):
    (exported / MANIFEST_NAME).unlink()
    if layout == "beside":
        as_siblings(exported)
    model, resolved = load_for_tier(exported, 1, strategy)
    where = "tiny/tier1" if layout == "inside" else "tiny-tier1"
    assert resolved.used == "sliced" and f"in the folder {where}/" in resolved.reason
    assert model.config.intermediate_size == 32
    torch.testing.assert_close(logits(model), logits(universal, 1))
    with pytest.raises(ManifestMissing, match="no slice folder tiny/tier3/ or tiny-tier3"):
        resolve(exported, 3, "sliced")


@pytest.mark.parametrize("strategy", ["auto", "sliced"])
def test_sibling_without_the_universal_folder(exported, universal, strategy):
    as_siblings(exported)
    shutil.rmtree(exported)
    model, resolved = load_for_tier(exported, 2, strategy)
    assert resolved.used == "sliced" and "unchecked against a universal" in resolved.reason
    torch.testing.assert_close(logits(model), logits(universal, 2))
    with pytest.raises(CheckpointError, match="neither a checkpoint folder"):
        resolve(exported, 3, strategy)  # no universal folder, no tiny-tier3


def test_sibling_of_another_tier_or_model_is_refused(exported, universal, tmp_path):
    as_siblings(exported)
    shutil.rmtree(tmp_path / "tiny-tier1")
    shutil.copytree(tmp_path / "tiny-tier2", tmp_path / "tiny-tier1")  # misnamed folder
    with pytest.raises(SliceMismatch, match="holds tier 2, not 1"):
        resolve(exported, 1, "sliced")
    model, resolved = load_for_tier(exported, 1, "auto")
    assert resolved.used == "universal" and "holds tier 2" in resolved.reason
    torch.testing.assert_close(logits(model), logits(universal, 1))

    other = AutoregressiveModel(tiny_config(num_key_value_heads=4))
    save_pretrained(other, tmp_path / "other")
    export_tiers(tmp_path / "other", [2])
    as_siblings(tmp_path / "other")
    shutil.rmtree(tmp_path / "tiny-tier2")
    shutil.copytree(tmp_path / "other-tier2", tmp_path / "tiny-tier2")
    with pytest.raises(SliceMismatch, match="another model than the universal"):
        resolve(exported, 2, "sliced")
    assert resolve(exported, 2, "auto").used == "universal"


def test_mix_n_match_sibling(tmp_path, universal):
    source = save_pretrained(universal, tmp_path / "tiny")
    export_tiers(source, [], mix_n_match=[[0, 2]])
    as_siblings(source)
    model, resolved = load_for_tier(source, [0, 2], "sliced")
    assert resolved.used == "sliced" and "tiny-mix-0-2" in resolved.reason
    torch.testing.assert_close(logits(model), logits(universal, [0, 2]))
