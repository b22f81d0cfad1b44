"""`built_aside`: files and folders appear whole, durably, or not at all."""

import os

import pytest

from matformer.modeling.atomic import built_aside
from matformer.modeling.mdat import Mdat


@pytest.fixture
def fsynced(monkeypatch) -> list[str]:
    """The paths os.fsync is called on, from now on."""
    paths: list[str] = []
    real = os.fsync

    def recording(descriptor: int) -> None:
        paths.append(os.readlink(f"/proc/self/fd/{descriptor}"))
        real(descriptor)

    monkeypatch.setattr(os, "fsync", recording)
    return paths


def test_a_folder_appears_whole_and_durable(tmp_path, fsynced) -> None:
    target = tmp_path / "out"
    with built_aside(target) as building:
        building.mkdir()
        (building / "data.txt").write_text("content")
        assert not target.exists()
    assert (target / "data.txt").read_text() == "content"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert fsynced[-1] == str(tmp_path)  # the rename itself is made durable
    assert any(p.endswith("data.txt") for p in fsynced)


def test_two_builds_of_one_target_do_not_collide(tmp_path) -> None:
    target = tmp_path / "file.txt"
    with built_aside(target) as first, built_aside(target) as second:
        assert first != second and first.parent == second.parent == tmp_path
        first.write_text("first")
        second.write_text("second")
    assert target.read_text() == "first"  # the last one to finish
    assert [p.name for p in tmp_path.iterdir()] == ["file.txt"]


def test_a_failed_build_leaves_nothing_and_keeps_the_old_file(tmp_path) -> None:
    target = tmp_path / "file.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError), built_aside(target) as building:
        building.write_text("half")
        raise RuntimeError("interrupted")
    assert [p.name for p in tmp_path.iterdir()] == ["file.txt"] and target.read_text() == "old"
    with built_aside(target) as building:
        building.write_text("new")
    assert target.read_text() == "new"


def test_a_view_is_durable_before_the_catalogue_lists_it(tmp_path, fsynced) -> None:
    with Mdat.create(tmp_path / "c") as mdat:
        mdat.add_records("a", [{"text": "one"}, {"text": "two"}])
        fsynced.clear()
        mdat.create_view("v", {"a": 1})
    assert any(p.endswith("a.npy") for p in fsynced)
    assert any(p.endswith("view.json") for p in fsynced)
    assert str(tmp_path / "c" / "views") in fsynced
