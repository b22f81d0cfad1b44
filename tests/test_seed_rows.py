"""The founding documents' features a user of them reaches for, each as the seed writes it
(issue 50; docs/seed_features.md lists every row with its home and its test)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch
from support.models import tiny_config

from matformer.modeling import AutoregressiveModel
from matformer.modeling.checkpoint import save_pretrained

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
