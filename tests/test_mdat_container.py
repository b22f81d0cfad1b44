"""The container folder, its catalogue, names and the submdat id limit."""

import sqlite3

import pytest

from modeling.errors import InvalidName, MdatExists, MdatNotFound, SubmdatLimit, UnknownName
from modeling.mdat import Mdat


def test_create_lays_out_the_folder_and_catalogue(tmp_path) -> None:
    path = tmp_path / "corpus"
    with Mdat.create(path) as mdat:
        assert mdat.max_submdats == 255
        assert mdat.submdats() == []
    assert sorted(p.name for p in path.iterdir()) == [
        "datasets", "functions", "mdat.db", "pretok", "shuffling", "views",
    ]
    tables = sqlite3.connect(path / "mdat.db").execute(
        "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name").fetchall()
    assert [t for (t,) in tables] == [
        "pretok", "settings", "shuffles", "strategies", "submdats", "views",
    ]
    assert not list(tmp_path.glob(".*building"))  # built aside, renamed into place


def test_open_finds_what_was_written(tmp_path) -> None:
    with Mdat.create(tmp_path / "c") as mdat:
        mdat.add_records("wiki", [{"text": "one"}, {"text": "two"}])
    with Mdat.open(tmp_path / "c") as mdat:
        (info,) = mdat.submdats()
        assert (info.id, info.name, info.documents, info.complete) == (1, "wiki", 2, True)
        assert mdat.submdat("wiki").text(1) == "two"


def test_open_without_catalogue_raises(tmp_path) -> None:
    with pytest.raises(MdatNotFound, match=r"not an MDAT container"):
        Mdat.open(tmp_path)


def test_create_refuses_a_non_empty_folder(tmp_path) -> None:
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(MdatExists, match=r"not empty"):
        Mdat.create(tmp_path)
    with Mdat.create(tmp_path / "empty_dir_is_fine"):
        pass


@pytest.mark.parametrize("name", ["../escape", "a b", "", ".hidden", "x/y"])
def test_names_must_be_plain_folder_names(tmp_path, name) -> None:
    with Mdat.create(tmp_path / "c") as mdat, pytest.raises(InvalidName, match=r"not allowed"):
        mdat.add_records(name, [{"text": "x"}])


def test_unknown_submdat_lists_existing(tmp_path) -> None:
    with Mdat.create(tmp_path / "c") as mdat:
        mdat.add_records("wiki", [{"text": "x"}])
        with pytest.raises(UnknownName, match=r"'wikki'.*wiki"):
            mdat.submdat("wikki")


def test_255_submdats_then_limit(tmp_path) -> None:
    with Mdat.create(tmp_path / "c") as mdat:
        for i in range(255):
            mdat.add_records(f"s{i}", [{"text": f"doc {i}"}])
        assert mdat.submdats()[-1].id == 255
        with pytest.raises(SubmdatLimit, match=r"extended=True"):
            mdat.add_records("one_more", [{"text": "x"}])
        assert len(mdat.submdats()) == 255


def test_extended_mode_goes_past_255(tmp_path) -> None:
    with Mdat.create(tmp_path / "c", extended=True) as mdat:
        assert mdat.max_submdats == 65_535
        for i in range(256):
            mdat.add_records(f"s{i}", [{"text": f"doc {i}"}])
        assert mdat.submdats()[-1].id == 256
        assert mdat.submdat("s255").text(0) == "doc 255"
