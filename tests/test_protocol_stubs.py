"""The committed stubs are exactly what the pinned generator makes from the ``.proto``."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest

from matformer.protocol.generate import GENERATOR_VERSION, REPO_ROOT, generate


def test_committed_stubs_match_the_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is missing: pip install -e '.[dev]'")
    installed = metadata.version("grpcio-tools")
    if installed != GENERATOR_VERSION:
        pytest.skip(f"grpcio-tools {installed} is installed; the stubs were generated with "
                    f"{GENERATOR_VERSION} and other versions write other bytes")
    for fresh in generate(tmp_path):
        committed = REPO_ROOT / fresh.relative_to(tmp_path)
        assert committed.read_bytes() == fresh.read_bytes(), (
            f"{committed.relative_to(REPO_ROOT)} is stale: run "
            "`python -m matformer.protocol.generate`"
        )


def test_stubs_import_from_the_package() -> None:
    from matformer.protocol.matformer.v1 import coordinator_pb2, coordinator_pb2_grpc

    assert coordinator_pb2.DESCRIPTOR.package == "matformer.v1"
    assert hasattr(coordinator_pb2_grpc, "CoordinatorStub")
