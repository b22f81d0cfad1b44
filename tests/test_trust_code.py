"""No code runs from a checkpoint, a coordinator or an MDAT container without consent.

Every case plants a module that, when imported, writes a marker file named after the process
that ran it, so a test sees exactly who executed it. The planted component's name is new in
every test, so no earlier import in this process can stand in for the checkpoint's code.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from support.helpers import run_tables, write_run_toml
from support.models import BYTE_IDS, tiny_config

from matformer.client.checkpoints import CheckpointFiles
from matformer.client.connection import Connection
from matformer.modeling.checkpoint import load_pretrained, save_pretrained
from matformer.modeling.checkpoint.files import CONFIG_NAME
from matformer.modeling.checkpoint.hf_config import to_config_dict
from matformer.modeling.checkpoint.loader import load_for_tier
from matformer.modeling.errors import (
    CodeOutsideCheckpoint,
    PathEscapesRepository,
    RemoteCodeRefused,
)
from matformer.modeling.mdat import Mdat, build_default_mdat
from matformer.modeling.models import build_model
from matformer.server.config import RunConfig
from matformer.server.errors import InvalidValue
from matformer.server.main import RunningServer

TOKEN = "trust-test"
PLANTED = '''
import os
from pathlib import Path

from torch import nn

from matformer.modeling import registry

Path({marker!r}, f"ran-{{os.getpid()}}").write_text({tag!r})


@registry.register("hook", {name!r}, "default")
class Planted(nn.Module):
    """Leaves the residual stream as it is: only its import matters."""

    def __init__(self, config, **_):
        super().__init__()

    def forward(self, x):
        return x
'''
PLANTED_SPLITTER = '''
import os
from pathlib import Path

from matformer.modeling import registry
from matformer.modeling.mdat.builtin_splitters import fixed_lengths

Path({marker!r}, f"ran-{{os.getpid()}}").write_text("splitter")


@registry.register("splitter", {name!r}, "default")
class Planted:
    def __init__(self, tokenizer, chunk_size, **_):
        self.tokenizer, self.chunk_size = tokenizer, chunk_size

    def __call__(self, document):
        tokens, _ = self.tokenizer.encode(document["data"])
        return {{"tokens": tokens, "chunks": fixed_lengths(len(tokens), self.chunk_size)}}
'''
_names = itertools.count()


def fresh_name() -> str:
    return f"planted_{uuid.uuid4().hex[:8]}_{next(_names)}"


def ran(marker: Path) -> dict[int, str]:
    """Which processes imported a planted module: pid -> its tag."""
    return {int(f.name.removeprefix("ran-")): f.read_text() for f in marker.glob("ran-*")}


def planted_checkpoint(folder: Path, marker: Path, *, listed: object = "planted.py",
                       tag: str = "checkpoint") -> Path:
    """A checkpoint whose model has a hook only the planted module registers. Its weights
    are a plain model's (the hook has none); its config.json lists ``listed``."""
    marker.mkdir(exist_ok=True)
    save_pretrained(build_model(tiny_config(vocab_size=260, max_position_embeddings=128,
                                            **BYTE_IDS)), folder)
    name = fresh_name()
    config = tiny_config(vocab_size=260, max_position_embeddings=128, **BYTE_IDS,
                         default_layer={"hooks": {"post_mlp": name}})
    listed = [listed] if isinstance(listed, str) else listed
    (folder / CONFIG_NAME).write_text(json.dumps(
        to_config_dict(config, {"external_modules_path": listed})))
    (folder / "planted.py").write_text(PLANTED.format(marker=str(marker), name=name, tag=tag))
    return folder


def test_a_checkpoints_code_runs_only_with_trust_remote_code(tmp_path):
    marker = tmp_path / "marker"
    folder = planted_checkpoint(tmp_path / "ckpt", marker)
    with pytest.raises(RemoteCodeRefused, match=r"planted\.py.*trust_remote_code=True"):
        load_pretrained(folder)
    with pytest.raises(RemoteCodeRefused, match=r"--trust-remote-code"):
        load_for_tier(folder, 1)
    assert ran(marker) == {}
    model = load_pretrained(folder, trust_remote_code=True)
    assert ran(marker) == {os.getpid(): "checkpoint"}
    sliced, resolved = load_for_tier(folder, 1, trust_remote_code=True)
    assert resolved.used == "universal" and sliced.config.intermediate_size == 32
    ids = torch.arange(3, 15)[None]
    with torch.no_grad():
        assert torch.isfinite(model(ids)).all()


def test_code_the_user_registered_already_needs_no_consent(tmp_path):
    """The checkpoint's file is not imported: the component comes from the user's own."""
    marker = tmp_path / "marker"
    folder = planted_checkpoint(tmp_path / "ckpt", marker)
    name = json.loads((folder / CONFIG_NAME).read_text())["default_layer"]["hooks"]["post_mlp"]
    own = tmp_path / "mine"
    own.mkdir()
    (own / "mine.py").write_text(PLANTED.format(marker=str(tmp_path / "mine"), name=name,
                                                tag="mine"))
    from matformer.modeling import registry
    registry.load_modules(str(own))
    load_pretrained(folder)
    assert ran(marker) == {}


@pytest.mark.parametrize("listed", ["absolute", "parent", "symlink", "folder", "nested"])
def test_module_files_outside_the_checkpoint_are_refused_even_when_trusted(tmp_path, listed):
    marker = tmp_path / "marker"
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    folder = tmp_path / "ckpt"
    entry = {"absolute": str(outside / "evil.py"), "parent": "../elsewhere/evil.py",
             "symlink": "planted.py", "folder": ".", "nested": "sub/planted.py"}[listed]
    planted_checkpoint(folder, marker, listed=entry if listed != "folder" else ".")
    if listed == "folder":  # a folder, not a list: "import every .py beside config.json"
        config = json.loads((folder / CONFIG_NAME).read_text())
        config["external_modules_path"] = "."
        (folder / CONFIG_NAME).write_text(json.dumps(config))
    (outside / "evil.py").write_text((folder / "planted.py").read_text())
    if listed == "symlink":
        (folder / "planted.py").unlink()
        (folder / "planted.py").symlink_to(outside / "evil.py")
    with pytest.raises(CodeOutsideCheckpoint):
        load_pretrained(folder, trust_remote_code=True)
    with pytest.raises(CodeOutsideCheckpoint):
        load_for_tier(folder, 1, trust_remote_code=True)
    assert ran(marker) == {}


def test_a_hub_snapshots_links_into_its_own_blobs_are_the_checkpoints_files(tmp_path):
    """The hub cache keeps a snapshot's files as links into the repository's blobs/."""
    marker = tmp_path / "marker"
    repo = tmp_path / "hub" / "models--org--planted"
    built = planted_checkpoint(tmp_path / "built", marker)
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for file in built.iterdir():
        blob = repo / "blobs" / uuid.uuid4().hex
        blob.write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(os.path.relpath(blob, snapshot))
    load_pretrained(snapshot, trust_remote_code=True)
    assert ran(marker) == {os.getpid(): "checkpoint"}


def _command(module: str, *args: str) -> subprocess.CompletedProcess:
    """``module``'s ``main`` (a console command's) run in a fresh process with ``args``."""
    return subprocess.run([sys.executable, "-c", f"from {module} import main; main()", *args],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_eval_and_generate_run_a_checkpoints_code_only_when_told(tmp_path):
    marker = tmp_path / "marker"
    folder = str(planted_checkpoint(tmp_path / "ckpt", marker))
    for refused in (_command("matformer.scripts.generate", folder, "--prompt", "def"),
                    _command("matformer.scripts.evaluate", folder, "--data",
                             str(tmp_path / "none"))):
        assert refused.returncode == 2, refused.stderr
        assert "--trust-remote-code" in refused.stderr and "Traceback" not in refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1
    assert ran(marker) == {}
    done = _command("matformer.scripts.generate", folder, "--prompt", "def",
                    "--max-new-tokens", "3", "--trust-remote-code")
    assert done.returncode == 0, done.stderr
    assert list(ran(marker).values()) == ["checkpoint"]


def _container(path: Path, marker: Path, splitter: str) -> Path:
    """A container whose functions/ plants code; its strategy "s" uses ``splitter``, either
    a built-in or the planted one (added here with consent, as its author did)."""
    name = fresh_name()
    with Mdat.create(path, trust_remote_code=True) as mdat:
        (mdat.path / "functions" / "planted.py").write_text(
            PLANTED_SPLITTER.format(marker=str(marker), name=name))
        mdat.add_records("docs", [{"text": "def f():\n    return 1\n"}] * 8)
        mdat.add_strategy({"strategy_name": "s", "chunk_size": 16,
                           "splitter_class": name if splitter == "planted" else splitter})
    for file in marker.glob("ran-*"):
        file.unlink()  # what the container's author ran, above
    return path


def test_a_containers_functions_never_run_without_consent(tmp_path):
    marker = tmp_path / "marker"
    marker.mkdir()
    model = planted_checkpoint(tmp_path / "ckpt", tmp_path / "unused")
    config = json.loads((model / CONFIG_NAME).read_text())
    config.update(external_modules_path=None, default_layer={})
    (model / CONFIG_NAME).write_text(json.dumps(config))
    custom = str(_container(tmp_path / "custom.mdat", marker, "planted"))
    plain = str(_container(tmp_path / "plain.mdat", marker, "fixed_chunks"))
    generate = ("matformer.scripts.generate", str(model), "--prompt", "def",
                "--max-new-tokens", "2", "--strategy", "s")
    refused = [_command(*generate, "--data", custom),
               _command("matformer.scripts.mdat_cli", "pretokenize", custom, "s")]
    for result in refused:
        assert result.returncode == 2, result.stderr
        assert "functions" in result.stderr and "--trust-remote-code" in result.stderr
    # a strategy of built-in parts works without it, and its container's code stays unrun
    assert _command(*generate, "--data", plain).returncode == 0
    assert _command("matformer.scripts.mdat_cli", "pretokenize", plain, "s").returncode == 0
    assert ran(marker) == {}
    allowed = _command("matformer.scripts.mdat_cli", "pretokenize", custom, "s",
                       "--trust-remote-code")
    assert allowed.returncode == 0, allowed.stderr
    assert list(ran(marker).values()) == ["splitter"]


def test_model_checkpoint_in_run_toml_runs_its_own_code_only_when_trusted(tmp_path,
                                                                          monkeypatch):
    """[model] checkpoint's module files are the checkpoint's, never the working folder's."""
    marker = tmp_path / "marker"
    folder = planted_checkpoint(tmp_path / "ckpt", marker, tag="the checkpoint's")
    decoy = tmp_path / "cwd"
    decoy.mkdir()
    (decoy / "planted.py").write_text(PLANTED.format(marker=str(marker), name=fresh_name(),
                                                     tag="the working folder's"))
    monkeypatch.chdir(decoy)
    build_default_mdat(tmp_path / "docs.mdat", limit=10).close()
    tables = run_tables(tmp_path / "docs.mdat", model={"checkpoint": str(folder)})
    with pytest.raises(InvalidValue, match=r"trust_remote_code"):
        RunConfig.from_dict(tables)
    tables["model"]["trust_remote_code"] = True
    config = RunConfig.from_dict(tables)
    assert config.model.build().external_modules_path == [str(folder / "planted.py")]
    build_model(config.model.build())
    assert ran(marker) == {os.getpid(): "the checkpoint's"}


def _served(tmp_path: Path, checkpoint: Path) -> RunningServer:
    build_default_mdat(tmp_path / "docs.mdat", limit=10).close()
    tables = run_tables(tmp_path / "docs.mdat", run={"id": "trust", "dir": "run"},
                        model={"checkpoint": str(checkpoint), "trust_remote_code": True},
                        round={"min_clients": 1, "deadline_s": 60.0, "tokens_per_round": 512,
                               "rounds": 2},
                        auth={"join_token": TOKEN})
    return RunningServer.start(RunConfig.load(write_run_toml(tmp_path / "run.toml", tables)),
                               grpc_port=0, http_port=0)


def test_a_client_runs_the_runs_code_only_when_its_operator_allows(tmp_path):
    """The coordinator's operator trusted its checkpoint; each client's operator decides."""
    marker = tmp_path / "marker"
    server = _served(tmp_path, planted_checkpoint(tmp_path / "ckpt", marker))
    try:
        def client(name: str, *extra: str) -> subprocess.CompletedProcess:
            return _command("matformer.client.cli", "train", "--server",
                            f"127.0.0.1:{server.grpc_port}",
                            "--join-token", TOKEN, "--name", name, "--tier", "1",
                            "--state-dir", str(tmp_path / name), "--max-rounds", "0",
                            "--no-progress", *extra)

        refused = client("wary")
        assert refused.returncode != 0
        assert "planted.py" in refused.stderr + refused.stdout
        assert "--trust-remote-code" in refused.stderr + refused.stdout
        assert set(ran(marker)) == {os.getpid()}  # the coordinator's own load, no other
        allowed = client("trusting", "--trust-remote-code")
        assert allowed.returncode == 0, allowed.stderr + allowed.stdout
        assert len(ran(marker)) == 2
    finally:
        server.stop()


@pytest.mark.parametrize("path", ["/tmp/matformer-escape/config.json",
                                  "../../../escape/config.json", "round-0/../../x.json",
                                  "linked/config.json"])
def test_a_coordinator_cannot_make_a_client_write_outside_its_cache(tmp_path, path):
    marker = tmp_path / "marker"
    server = _served(tmp_path, planted_checkpoint(tmp_path / "ckpt", marker))
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "linked").symlink_to(tmp_path / "outside", target_is_directory=True)
    (tmp_path / "outside").mkdir()
    try:
        connection = Connection(f"127.0.0.1:{server.grpc_port}")
        files = CheckpointFiles(connection, cache)
        with pytest.raises(PathEscapesRepository, match="outside this client's cache"):
            files.fetch(path)
        assert not any((tmp_path / "outside").iterdir())
        assert not Path("/tmp/matformer-escape").exists()
        assert not (tmp_path / "escape").exists()
    finally:
        server.stop()

