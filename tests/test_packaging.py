"""Everything installs and imports as ``matformer.*`` (no generic top-level package does), and
a plain install, without the extras, runs a member, a coordinator and the testnet."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import matformer

REPO = Path(__file__).resolve().parent.parent
FOLDERS = ("modeling", "server", "client", "relay", "scripts", "protocol", "local_testnet")


def test_the_package_says_its_installed_version():
    assert matformer.__version__ == metadata.version("matformer")


def test_only_the_matformer_namespace_is_importable_outside_the_checkout(tmp_path):
    # a user's own modeling.py beside their script must not shadow ours, nor ours theirs
    (tmp_path / "modeling.py").write_text("MINE = True\n")
    probe = ("import importlib.util, modeling, matformer.modeling.checkpoint as c\n"
             f"print(modeling.MINE, [importlib.util.find_spec(n) for n in {FOLDERS[1:]!r}])\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", *["[None,", *["None,"] * (len(FOLDERS) - 3),
                                            "None]"]]


def test_no_source_file_imports_a_folder_by_its_bare_name():
    bare = []
    for folder in (*FOLDERS, "tests", "bench", "matformer"):
        for path in (REPO / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = ([node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                         else [a.name for a in node.names] if isinstance(node, ast.Import)
                         else [])
                bare += [f"{path.relative_to(REPO)}: {name}" for name in names
                         if name.split(".")[0] in FOLDERS]
    assert bare == []


def test_members_coordinators_and_the_testnet_need_no_extra(tmp_path):
    # the extras' packages made unimportable, as on a plain install
    probe = """
import sys
for extra in ("matplotlib", "transformers", "pyarrow", "datasets", "flash_attn", "liger_kernel"):
    sys.modules[extra] = None
import matformer.client.cli, matformer.client.standalone, matformer.server.main
from matformer.local_testnet import main
from matformer.local_testnet.report import write_plot
print(write_plot({"run_id": "r"}, __import__("pathlib").Path("loss.png")))
"""
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None"] and not (tmp_path / "loss.png").exists()
