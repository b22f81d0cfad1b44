"""`matformer slice`: per-layer FFN widths measured on held-out data, chosen within a budget,
the Pareto points reported and the choice exported beside the checkpoint's other slices."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import torch
from support.models import tiny_config

from matformer.modeling import AutoregressiveModel
from matformer.modeling.checkpoint import load_pretrained
from matformer.modeling.checkpoint.export import export_tiers, read_manifest
from matformer.modeling.checkpoint.pretrained import save_pretrained
from matformer.modeling.checkpoint.slicing import slice_state, sliced_parameters
from matformer.modeling.matformer import layer_widths
from matformer.modeling.naming import canonical_state_dict
from matformer.scripts.slice_mix import Point, main, mixes, pareto

LAYERS = 3


@pytest.fixture()
def checkpoint(tmp_path):
    torch.manual_seed(0)
    model = AutoregressiveModel(tiny_config(vocab_size=260, max_position_embeddings=128,
                                            num_hidden_layers=LAYERS))
    return save_pretrained(model, tmp_path / "ck"), model


def sliced(checkpoint, mdat_path, tmp_path, *extra):
    out = tmp_path / "slice.json"
    main([str(checkpoint), "--data", str(mdat_path), "--seq-len", "128", "--limit", "6",
          "--json", str(out), *extra])
    return json.loads(out.read_text())


def test_every_mix_within_the_budget_is_measured_and_the_best_exported(
        checkpoint, mdat_path, tmp_path, capsys):
    source, model = checkpoint
    export_tiers(source, [2])  # a slice written before: still there after
    figures = sliced(source, mdat_path, tmp_path, "--budget", "0.6", "--tiers", "0,1,2")
    # 3 layers over 3 tiers, widths never growing with depth: 10 mixes, of which those of at
    # most 60% of the FFN neurons are measured, and the uniform tiers beside them
    assert figures["mixes"] == 10 == len(mixes([0, 1, 2], LAYERS))
    assert figures["search"] == "exhaustive"
    shares = {tuple(p["layer_tiers"]): p["share"] for p in figures["points"]}
    fitting = [m for m in mixes([0, 1, 2], LAYERS)
               if sum(64 >> t for t in m) / (64 * LAYERS) <= 0.6]
    assert set(shares) == {*fitting, (0, 0, 0)}
    chosen = figures["chosen"]
    assert chosen["share"] <= 0.6
    assert chosen["loss"] == min(p["loss"] for p in figures["points"] if p["share"] <= 0.6)
    front = figures["pareto"]
    assert all(a["parameters"] < b["parameters"] and a["loss"] > b["loss"]
               for a, b in itertools.pairwise(front))
    # the exported slice is the model at that mix, bit for bit, and the earlier one stays
    layer_tiers = list(chosen["layer_tiers"])
    folder = source / figures["exported"].rsplit("/", 1)[1]
    ids = torch.randint(3, 250, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(load_pretrained(folder)(ids), model(ids, tier=layer_tiers))
    listed = {entry.tier for entry in read_manifest(source).tiers}
    assert 2 in listed and (layer_tiers[0] if len(set(layer_tiers)) == 1
                            else tuple(layer_tiers)) in listed
    out = capsys.readouterr().out
    assert "<- chosen" in out and "uniform tier 1" in out


def test_many_mixes_are_searched_greedily_within_the_budget(checkpoint, mdat_path, tmp_path):
    source, _ = checkpoint
    figures = sliced(source, mdat_path, tmp_path, "--budget", "0.7", "--tiers", "0,1,2",
                     "--max-candidates", "4", "--no-export", "--of", "model")
    assert figures["search"] == "greedy" and figures["exported"] is None
    assert figures["measured"] < figures["mixes"]
    assert figures["chosen"]["share"] <= 0.7
    assert not (source / "mix-0-1-2").exists()


@pytest.mark.parametrize(("budget", "tiers", "said"), [
    ("0", "0,1", "give a share of the model in (0, 1]"),
    ("0.3", "0,1", "below the narrowest slice of tiers [0, 1] (0.500"),
    ("0.6", "0,9", "tier"),
])
def test_a_budget_or_tiers_that_cannot_be_met_is_said(checkpoint, mdat_path, tmp_path, capsys,
                                                      budget, tiers, said):
    source, _ = checkpoint
    with pytest.raises(SystemExit) as exit_:
        sliced(source, mdat_path, tmp_path, "--budget", budget, "--tiers", tiers)
    assert exit_.value.code == 2 and said in capsys.readouterr().err


def test_sizes_are_counted_as_slicing_would_leave_them(checkpoint):
    _, model = checkpoint
    state = canonical_state_dict(model)
    shapes = {name: tuple(t.shape) for name, t in state.items()}
    for mix in mixes([0, 1, 2], LAYERS):
        widths = layer_widths(model.config, list(mix))
        total, ffn = sliced_parameters(shapes, widths)
        kept = slice_state(state, widths)
        assert total == sum(t.numel() for t in kept.values())
        assert ffn == sum(t.numel() for n, t in kept.items() if ".mlp." in n)


def test_the_pareto_front_keeps_only_what_nothing_beats():
    points = [Point((2, 2), 10, 5, 0.25, 3.0), Point((1, 2), 12, 6, 0.3, 3.1),
              Point((1, 1), 14, 7, 0.5, 2.9), Point((0, 1), 16, 8, 0.75, 2.9),
              Point((0, 0), 18, 9, 1.0, 2.8)]
    assert [p.layer_tiers for p in pareto(points)] == [(2, 2), (1, 1), (0, 0)]
    assert np.isclose(points[0].share, 0.25)
