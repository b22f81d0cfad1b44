"""Integrity in transit: the coordinator serves only manifest-listed files that match their
sha256, and the client refuses a damaged download and fetches it again (loopback gRPC)."""

from __future__ import annotations

import logging
from pathlib import Path

import grpc
import pytest
from support.helpers import JOIN_TOKEN, served_run_toml
from support.wire import code_of, http_get

from matformer.client.checkpoints import DOWNLOAD_ATTEMPTS, CheckpointFiles
from matformer.client.connection import Connection
from matformer.client.errors import DamagedOnServer, DamagedTransfer
from matformer.modeling.checkpoint.loader import load, resolve
from matformer.modeling.checkpoint.manifest import MANIFEST_NAME
from matformer.modeling.naming import canonical_state_dict
from matformer.protocol.files import receive_file
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.server import served_files
from matformer.server.config import RunConfig
from matformer.server.main import RunningServer

SLICE = "round-0/tier1/model.safetensors"  # listed only as tier1/... in round-0's


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    config = RunConfig.load(served_run_toml(tmp_path_factory.mktemp("transit")))
    server = RunningServer.start(config, grpc_port=0, http_port=0)
    assert server.wait_until_http_ready()
    connection = Connection(f"127.0.0.1:{server.grpc_port}", patience_s=5.0)
    connection.join(name="alice", run_id="svc-test", join_token=JOIN_TOKEN, device_kind="cpu",
                    device_name="test", memory_bytes=2**34, load_strategy="auto",
                    microbatch_tokens=2048, tier=0)
    yield server, connection
    connection.close()
    server.stop()


@pytest.fixture
def checkpoints(running) -> Path:
    return running[0].coordinator.checkpoints.root


@pytest.fixture
def corrupting(monkeypatch):
    """Make the server's send path flip one byte of the first data chunk of the transfers
    ``plan`` picks by number; the announced sha256 stays the real one, as on a bad link."""
    sent: list[str] = []

    def install(plan):
        real = served_files.send_file

        def send_file(path, *args, **kwargs):
            sent.append(path.name)
            corrupt = plan(len(sent))
            for chunk in real(path, *args, **kwargs):
                if corrupt and chunk.data:
                    chunk.data = bytes([chunk.data[0] ^ 0xFF]) + chunk.data[1:]
                    corrupt = False
                yield chunk

        monkeypatch.setattr(served_files, "send_file", send_file)
        return sent

    return install


def download(connection: Connection, path: str, dest: Path) -> Path:
    connection.download(path, dest)
    return dest


def test_only_manifest_listed_files_are_served(running, checkpoints, tmp_path):
    server, connection = running
    for listed in (f"round-0/{MANIFEST_NAME}", "round-0/config.json", SLICE):
        got = download(connection, listed, tmp_path / "got")
        assert got.read_bytes() == (checkpoints / listed).read_bytes()
        status, body = http_get(server, f"/files/{listed}")
        assert status == 200 and body == got.read_bytes()
    (checkpoints / "round-0" / "stray.bin").write_bytes(b"not in any manifest")
    (checkpoints / ".round-0.tmp-0000").mkdir(exist_ok=True)
    (checkpoints / ".round-0.tmp-0000" / "config.json").write_text("{}")
    (checkpoints / "notes.txt").write_text("operator's notes")
    for stray in ("round-0/stray.bin", ".round-0.tmp-0000/config.json", "notes.txt",
                  "round-0/missing.safetensors"):
        code, details = code_of(lambda stray=stray: next(connection.stub.DownloadCheckpoint(
            pb.DownloadCheckpointRequest(path=stray), metadata=connection.metadata)))
        assert code == grpc.StatusCode.NOT_FOUND and "only checkpoint manifests" in details
        status, body = http_get(server, f"/files/{stray}")
        assert status == 404 and b"only checkpoint manifests" in body
    code, _ = code_of(lambda: next(connection.stub.DownloadCheckpoint(
        pb.DownloadCheckpointRequest(path="../state.json"), metadata=connection.metadata)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert http_get(server, "/files/%2e%2e/state.json")[0] == 404


def test_a_file_damaged_on_the_servers_disk_is_never_served(running, checkpoints, tmp_path,
                                                            caplog):
    server, connection = running
    target = checkpoints / SLICE
    good = target.read_bytes()
    download(connection, SLICE, tmp_path / "first")  # its digest is cached now
    try:
        target.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))  # same size, new mtime
        stream = connection.stub.DownloadCheckpoint(pb.DownloadCheckpointRequest(path=SLICE),
                                                    metadata=connection.metadata)
        received = []
        with caplog.at_level(logging.ERROR, logger="matformer.server"):
            code, details = code_of(lambda: received.extend(stream))
        assert code == grpc.StatusCode.DATA_LOSS and received == []
        assert SLICE in details and "sha256" in details
        assert any(SLICE in r.getMessage() for r in caplog.records)
        status, body = http_get(server, f"/files/{SLICE}")
        assert status == 500 and SLICE.encode() in body
        files = CheckpointFiles(connection, tmp_path / "cache", log=pytest.fail)
        files.fetch(f"round-0/{MANIFEST_NAME}")
        with pytest.raises(DamagedOnServer, match="operator"):
            files.fetch(SLICE)
        assert not (tmp_path / "cache" / SLICE).exists()
    finally:
        target.write_bytes(good)
    assert download(connection, SLICE, tmp_path / "again").read_bytes() == good


def test_a_file_rewritten_while_it_is_sent_is_cut_off(running, checkpoints, monkeypatch,
                                                       tmp_path):
    _, connection = running
    target = checkpoints / SLICE
    good = target.read_bytes()
    download(connection, SLICE, tmp_path / "first")  # checked before sending: cached as good
    real = served_files.send_file

    def rewritten_meanwhile(path, *args, **kwargs):
        path.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(served_files, "send_file", rewritten_meanwhile)
    try:
        code, details = code_of(lambda: receive_file(connection.stub.DownloadCheckpoint(
            pb.DownloadCheckpointRequest(path=SLICE), metadata=connection.metadata),
            tmp_path / "partial"))
        assert code == grpc.StatusCode.DATA_LOSS and "while it was sent" in details
        assert list(tmp_path.glob("*partial*")) == []
    finally:
        target.write_bytes(good)


def test_a_download_damaged_in_transit_is_refused_and_fetched_again(running, corrupting,
                                                                     tmp_path):
    server, connection = running
    sent = corrupting(lambda n: n == 2)  # the manifest arrives whole, then config.json doesn't
    logs: list[str] = []
    files = CheckpointFiles(connection, tmp_path / "cache", log=logs.append)
    resolved = resolve("round-0", 1, "sliced", repository=files)
    model = load(resolved)
    assert sent[:3] == [MANIFEST_NAME, "config.json", "config.json"]
    assert files.downloaded == [f"round-0/{MANIFEST_NAME}", "round-0/config.json",
                                "round-0/tier1/config.json", SLICE, "round-0/tokenizer.json",
                                "round-0/tokenizer_config.json"]  # the tier's common files
    (line,) = logs
    assert "refused download 1 of 3 of round-0/config.json" in line and "sha256" in line
    master = server.service.coordinator.master
    held = canonical_state_dict(model)
    up = "model.layers.0.mlp.up_proj.weight"
    assert held[up].equal(master[up][: held[up].shape[0]])
    assert not list((tmp_path / "cache").rglob(".*.tmp-*"))  # no download left half-made


def test_a_download_damaged_every_time_fails_after_three_attempts(running, corrupting,
                                                                   tmp_path):
    _, connection = running
    logs: list[str] = []
    files = CheckpointFiles(connection, tmp_path / "cache", log=logs.append)
    files.fetch(f"round-0/{MANIFEST_NAME}")
    sent = corrupting(lambda n: True)
    with pytest.raises(DamagedTransfer, match=f"all {DOWNLOAD_ATTEMPTS} downloads") as err:
        files.fetch(SLICE)
    assert SLICE in str(err.value) and "sha256" in str(err.value)
    assert len(sent) == DOWNLOAD_ATTEMPTS == len(logs)
    assert list((tmp_path / "cache" / "round-0" / "tier1").iterdir()) == []
