"""The container folder, its catalogue, names and the submdat id limit."""

import sqlite3
from dataclasses import astuple

import pytest

from matformer.modeling.errors import (
    InvalidName,
    MdatExists,
    MdatFormatError,
    MdatNotFound,
    SubmdatLimit,
    UnknownName,
)
from matformer.modeling.mdat import Mdat, SubmdatInfo


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


def test_a_path_that_does_not_exist_is_called_missing_not_a_wrong_folder(tmp_path) -> None:
    with pytest.raises(MdatNotFound, match=r"nope: no such file or folder; give the path of"):
        Mdat.open(tmp_path / "nope")


def test_another_format_version_is_refused(tmp_path) -> None:
    Mdat.create(tmp_path / "c").close()
    with sqlite3.connect(tmp_path / "c" / "mdat.db") as db:
        db.execute("UPDATE settings SET value = '1' WHERE key = 'format_version'")
    db.close()
    with pytest.raises(MdatFormatError, match=r"format 1; this code reads format 2.*again"):
        Mdat.open(tmp_path / "c")


def test_create_refuses_a_non_empty_folder(tmp_path) -> None:
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(MdatExists, match=r"not empty"):
        Mdat.create(tmp_path)
    (tmp_path / "empty_dir_is_fine").mkdir()
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


def fill_catalogue(path, count: int) -> None:
    """Rows of ``count`` interrupted, empty imports: as good as real ones for the id limit."""
    rows = [astuple(SubmdatInfo(i, f"s{i}", "python", "text", "none"))
            for i in range(1, count + 1)]
    with sqlite3.connect(path / "mdat.db") as db:
        db.executemany(f"INSERT INTO submdats VALUES ({', '.join('?' * len(rows[0]))})", rows)
    db.close()


def test_255_submdats_then_limit(tmp_path) -> None:
    Mdat.create(tmp_path / "c").close()
    fill_catalogue(tmp_path / "c", 254)
    with Mdat.open(tmp_path / "c") as mdat:
        mdat.add_records("last", [{"text": "doc 255"}])
        assert mdat.submdats()[-1].id == 255
        with pytest.raises(SubmdatLimit, match=r"remove one, or .*extended=True"):
            mdat.add_records("one_more", [{"text": "x"}])
        assert len(mdat.submdats()) == 255
        mdat.remove_submdat("s7")
        assert mdat.add_records("one_more", [{"text": "x"}]).id == 7


def test_extended_mode_goes_past_255(tmp_path) -> None:
    Mdat.create(tmp_path / "c", extended=True).close()
    fill_catalogue(tmp_path / "c", 255)
    with Mdat.open(tmp_path / "c") as mdat:
        assert mdat.max_submdats == 65_535
        mdat.add_records("s256", [{"text": "doc 256"}])
        assert mdat.submdats()[-1].id == 256
        assert mdat.submdat("s256").text(0) == "doc 256"
