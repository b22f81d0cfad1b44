"""Shared fixtures: a tiny universal model, a small MDAT, a clean registry state, and the
``cuda`` marker's skip. What tests import lives in ``tests/support/`` (``support.models``,
``support.helpers``, ...), imported by that package's name."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from support.models import tiny_config

from matformer.modeling import AutoregressiveModel, registry
from matformer.modeling.mdat import build_default_mdat


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``cuda`` are skipped, with the reason, where torch sees no CUDA device. A
    module whose ``DEVICE`` is not CUDA runs its tests there instead (tests/test_cuda.py under
    MATFORMER_TEST_DEVICE=cpu: its bodies checked on a machine without a GPU)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device (torch {torch.__version__} sees none)")
    for item in items:
        device = getattr(getattr(item, "module", None), "DEVICE", None)
        if item.get_closest_marker("cuda") and (device is None or device.type == "cuda"):
            item.add_marker(skip)


@pytest.fixture
def universal():
    torch.manual_seed(0)
    return AutoregressiveModel(tiny_config()).eval()


@pytest.fixture(scope="module")
def mdat_path(tmp_path_factory) -> Path:
    """The embedded default corpus's first 30 documents as an MDAT (a coordinator's data)."""
    path = tmp_path_factory.mktemp("data") / "docs.mdat"
    build_default_mdat(path, limit=30).close()
    return path


@pytest.fixture(autouse=True)
def _clean_registry_state(monkeypatch):
    """No test sees another's preferences or MATFORMER_* environment overrides."""
    for key in list(os.environ):
        if key.startswith("MATFORMER_"):
            monkeypatch.delenv(key)
    registry.clear_preferences()
    torch.manual_seed(0)
    yield
    registry.clear_preferences()


@pytest.fixture(scope="module")
def one_torch_thread():
    """On tiny models a second torch thread only waits for the first, and on a busy
    machine that wait costs a hundred times the step (docs/hardware.md, "Threads"); a module
    marks itself with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
