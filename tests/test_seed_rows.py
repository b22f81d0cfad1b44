"""The founding documents' features a user of them reaches for, each as the seed writes it
(issue 50; docs/seed_features.md lists every row with its home and its test)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import torch
from support.models import tiny_config

from matformer.modeling import AutoregressiveModel, Registry
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
