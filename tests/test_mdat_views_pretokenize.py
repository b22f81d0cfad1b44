"""A view pretokenized on its own: only its documents are tokenized, it reads the same
sequences as when its submdats are pretokenized whole, and neither order of the two steps
changes its ids, its fingerprint or its shuffles; an unknown view is refused naming the fix."""

import numpy as np
import pytest

from matformer.modeling.errors import PretokIncomplete, UnknownName
from matformer.modeling.mdat import Mdat
from matformer.modeling.mdat import pretok_workers as workers_module
from matformer.scripts.mdat_cli import main

STRATEGY = {"strategy_name": "b", "chunk_size": 8}
QUOTAS = {"a": 9, "b": 0.25}


def texts(prefix: str, count: int) -> list[dict]:
    return [{"text": f"{prefix} {i}: " + "token " * (i % 7 + 1)} for i in range(count)]


@pytest.fixture
def mdat(tmp_path):
    with Mdat.create(tmp_path / "c") as mdat:
        mdat.add_records("a", texts("alpha", 30))
        mdat.add_records("b", texts("beta", 20))
        mdat.add_strategy(STRATEGY)
        mdat.create_view("small", QUOTAS, seed=4)
        yield mdat


def read(mdat: Mdat, view: str) -> tuple[list[list[int]], list[tuple]]:
    reader = mdat.sequences("b", 16, view)
    return ([reader[i].tolist() for i in range(len(reader))],
            [(loc.submdat, loc.document, loc.first_chunk, loc.ends_document)
             for loc in map(reader.locate, range(len(reader)))])


def test_a_view_pretokenized_alone_reads_as_through_the_whole_submdats(mdat) -> None:
    own = mdat.pretokenize_view("b", "small")
    assert [(p.submdat_id, p.documents, p.complete) for p in own] == [(1, 9, True), (2, 5, True)]
    assert not any(p.complete or p.documents for p in mdat.pretok_status("b"))
    mdat.create_view("twin", QUOTAS, seed=4)  # the same documents, to read from elsewhere
    with pytest.raises(PretokIncomplete, match=r"or only view 'twin''s documents with "
                                               r"`matformer-mdat pretokenize .* b --view twin`"):
        mdat.sequences("b", 16, "twin")
    alone = read(mdat, "small")
    mdat.pretokenize("b")
    assert read(mdat, "twin") == alone  # twin reads the whole submdats' files
    assert alone[1][0][:2] == ("a", int(np.sort(
        np.random.default_rng([4, 1]).permutation(30)[:9])[0]))  # the submdat's numbering


def test_pretokenizing_whole_after_the_view_changes_nothing_the_view_reads(mdat) -> None:
    mdat.pretokenize_view("b", "small")
    before = (read(mdat, "small"), mdat.fingerprint("b", 16, "small"))
    order = mdat.shuffle("small", "b", 16, seed=1)
    mdat.pretokenize("b")
    assert (read(mdat, "small"), mdat.fingerprint("b", 16, "small")) == before
    assert np.array_equal(mdat.load_shuffle("small", "b", 16, seed=1), order)  # not stale
    assert mdat.pretokenize_view("b", "small") == mdat.view_pretok_status("b", "small")


def test_a_view_of_submdats_pretokenized_whole_writes_nothing_and_drops_a_partial_run(
        mdat, monkeypatch) -> None:
    split_batch, calls = workers_module.split_batch, []

    def interrupted(splitter, batch):  # the process dies during the second batch
        calls.append(batch)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return split_batch(splitter, batch)

    monkeypatch.setattr(workers_module, "split_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mdat.pretokenize_view("b", "small", batch_size=4)
    monkeypatch.undo()
    assert [(p.documents, p.complete) for p in mdat.view_pretok_status("b", "small")] == [
        (4, False)]
    mdat.pretokenize("b")
    fingerprint = mdat.fingerprint("b", 16, "small")
    assert mdat.pretokenize_view("b", "small") == []  # read from the whole submdats
    assert not (mdat.path / "views" / "small" / "pretok" / "b" / "a").exists()
    assert mdat.fingerprint("b", 16, "small") == fingerprint


def test_removing_a_view_removes_its_own_files_and_progress(mdat) -> None:
    mdat.pretokenize_view("b", "small")
    mdat.remove_view("small")
    assert not (mdat.path / "views" / "small").exists()
    mdat.create_view("small", {"a": 3})
    assert mdat.view_pretok_status("b", "small") == []
    with pytest.raises(PretokIncomplete):
        mdat.sequences("b", 16, "small")


def test_an_unknown_view_is_refused_naming_what_to_do(mdat, capsys) -> None:
    with pytest.raises(UnknownName, match=r"unknown view 'smal'; the container has: small \(and "
                                          r"'default', every document\)\. Create the view first "
                                          r"\(`matformer-mdat view .*c smal SUBMDAT=QUOTA`, "
                                          r"Mdat\.create_view\), or pretokenize whole submdats"):
        mdat.pretokenize_view("b", "smal")
    path = str(mdat.path)
    with pytest.raises(SystemExit) as refused:
        main(["pretokenize", path, "b", "--view", "smal"])
    assert refused.value.code == 2
    assert "matformer-mdat: error: unknown view 'smal'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a view, or submdats: not both
        main(["pretokenize", path, "b", "--view", "small", "--submdat", "a"])
    assert "argument --submdat: not allowed with argument --view" in capsys.readouterr().err


def test_cli_pretokenizes_a_view_and_info_lists_its_own_files(mdat, capsys) -> None:
    main(["pretokenize", str(mdat.path), "b", "--view", "small"])
    assert capsys.readouterr().out.startswith("b, view small: its own files hold a ")
    main(["info", str(mdat.path)])
    out = capsys.readouterr().out
    assert "a: not complete, 0 documents" in out
    assert "a for view small (its own files): complete, 9 documents" in out
    assert "b for view small (its own files): complete, 5 documents" in out
