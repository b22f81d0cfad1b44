"""Every benchmark under bench/ imports against the code as it is now, so none rots unseen
(bench/federated_quality.py once imported a function the client no longer had), in one
process and in seconds, and each answers ``--help`` (bench/scale.py's once raised a
TypeError: a help string held a bare ``%``). Each one's run, at tiny sizes, is
tests/test_bench_smoke.py's."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.mark.parametrize("script", sorted(p.stem for p in BENCH.glob("*.py")))
def test_the_benchmark_imports_and_answers_help(script, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))  # benchmarks import their harness as a sibling
    module = importlib.import_module(script)
    assert module.__file__ == str(BENCH / f"{script}.py")
    if script != "harness":
        assert callable(getattr(module, "main", None)), f"bench/{script}.py has no main()"
        monkeypatch.setattr(sys, "argv", [f"{script}.py", "--help"])
        with pytest.raises(SystemExit) as exited:
            module.main()
        assert exited.value.code == 0
        assert "usage:" in capsys.readouterr().out
    sys.modules.pop(script, None)
