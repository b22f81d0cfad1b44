"""Removing submdats and views: names and ids come free, derived files go with them."""

import pytest

from matformer.modeling.errors import InvalidName, SubmdatInUse, UnknownName
from matformer.modeling.mdat import Mdat


@pytest.fixture
def mdat(tmp_path):
    with Mdat.create(tmp_path / "c") as mdat:
        for name in ("a", "b", "c"):
            mdat.add_records(name, [{"text": f"the documents of {name}"}] * 3)
        mdat.add_strategy({"strategy_name": "s", "chunk_size": 8})
        mdat.pretokenize("s")
        yield mdat


def test_removing_a_submdat_frees_its_name_and_id(mdat) -> None:
    mdat.create_view("v", {"a": 2})
    mdat.shuffle(None, "s", 8, seed=0)
    mdat.shuffle("v", "s", 8, seed=0)
    mdat.remove_submdat("b")
    assert [(info.id, info.name) for info in mdat.submdats()] == [(1, "a"), (3, "c")]
    assert not (mdat.path / "datasets" / "b").exists()
    assert not (mdat.path / "pretok" / "s" / "b").exists()
    # The default view's shuffle included b; the view's did not.
    assert [s.name for s in mdat.shuffles()] == ["v.s.8.seed0"]
    assert sorted(p.name for p in (mdat.path / "shuffling").iterdir()) == ["v.s.8.seed0.npy"]
    info = mdat.add_records("b", [{"text": "new"}])
    assert info.id == 2
    mdat.pretokenize("s")
    assert mdat.sequences("s", 8).locate(9).submdat == "b"  # a: 3 documents of 3 chunks


def test_a_submdat_a_view_uses_is_kept(mdat) -> None:
    mdat.create_view("v1", {"a": 1})
    mdat.create_view("v2", {"a": 1, "b": 1})
    with pytest.raises(SubmdatInUse, match=r"'a' is used by view\(s\) v1, v2; remove them"):
        mdat.remove_submdat("a")
    assert [info.name for info in mdat.submdats()] == ["a", "b", "c"]


def test_an_interrupted_import_can_be_removed(mdat) -> None:
    def failing():
        yield {"text": "imported"}
        raise RuntimeError("source went away")

    with pytest.raises(RuntimeError):
        mdat.add_records("d", failing(), batch_size=1)
    mdat.remove_submdat("d")
    info = mdat.add_records("d", [{"text": "another source"}])
    assert (info.id, info.documents, info.complete) == (4, 1, True)
    assert mdat.submdat("d").text(0) == "another source"


def test_removing_a_view_removes_its_shuffles(mdat) -> None:
    mdat.create_view("v", {"a": 2})
    mdat.shuffle("v", "s", 8, seed=0)
    mdat.shuffle(None, "s", 8, seed=0)
    mdat.remove_view("v")
    assert mdat.views() == [] and not (mdat.path / "views" / "v").exists()
    assert [s.name for s in mdat.shuffles()] == ["default.s.8.seed0"]
    assert not (mdat.path / "shuffling" / "v.s.8.seed0.npy").exists()
    assert mdat.create_view("v", {"b": 1}).documents == {"b": 1}  # the name is free
    with pytest.raises(InvalidName, match=r"cannot be removed"):
        mdat.remove_view("default")
    with pytest.raises(UnknownName, match=r"unknown view 'w'"):
        mdat.remove_view("w")
