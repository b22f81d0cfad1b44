"""Views and shuffles: deterministic; a view shuffle's rounds split disjoint and covering."""

import json

import numpy as np
import pytest

from matformer.modeling.corpus import python_docs
from matformer.modeling.errors import (
    InvalidName,
    NameTaken,
    QuotaError,
    QuotaTooLarge,
    UnknownName,
)
from matformer.modeling.mdat import Mdat
from matformer.server.work import assign

DOCS = list(python_docs(limit=50))


@pytest.fixture(scope="module")
def mdat(tmp_path_factory):
    with Mdat.create(tmp_path_factory.mktemp("views") / "c") as mdat:
        mdat.add_records("a", ({"text": t} for t in DOCS[:30]))
        mdat.add_records("b", ({"text": t} for t in DOCS[30:]))
        mdat.add_strategy({"strategy_name": "s", "chunk_size": 64})
        mdat.pretokenize("s")
        yield mdat


def test_count_fraction_and_size_quotas(mdat) -> None:
    view = mdat.create_view("mixed", {"a": 10, "b": "2K"}, seed=3)
    chosen_a = np.load(mdat.path / "views" / "mixed" / "a.npy")
    chosen_b = np.load(mdat.path / "views" / "mixed" / "b.npy")
    assert len(chosen_a) == 10 and np.all(np.diff(chosen_a) > 0)
    sizes_b = mdat.submdat("b").sizes
    assert sizes_b[chosen_b].sum() >= 2048
    assert view.documents == {"a": 10, "b": len(chosen_b)}
    on_disk = json.loads((mdat.path / "views" / "mixed" / "view.json").read_text())
    assert on_disk == {"seed": 3, "quotas": {"a": 10, "b": "2K"}, "documents": view.documents}
    half = mdat.create_view("half", {"a": 0.5})
    assert half.documents == {"a": 15}
    assert [v.name for v in mdat.views()] == ["half", "mixed"]


def test_view_selection_is_deterministic_by_seed(mdat) -> None:
    mdat.create_view("s1", {"a": 12}, seed=7)
    mdat.create_view("s1_again", {"a": 12}, seed=7)
    mdat.create_view("s2", {"a": 12}, seed=8)
    folder = mdat.path / "views"
    same = np.load(folder / "s1" / "a.npy"), np.load(folder / "s1_again" / "a.npy")
    assert np.array_equal(*same)
    assert not np.array_equal(same[0], np.load(folder / "s2" / "a.npy"))


def test_view_sequences_come_from_chosen_documents(mdat) -> None:
    mdat.create_view("only_a", {"a": 5}, seed=1)
    chosen = set(np.load(mdat.path / "views" / "only_a" / "a.npy").tolist())
    reader = mdat.sequences("s", 128, view="only_a")
    places = [reader.locate(i) for i in range(len(reader))]
    assert {p.submdat for p in places} == {"a"}
    assert {p.document for p in places} == chosen
    full = mdat.submdat("a")
    expected = b"".join(full.raw(d) for d in sorted(chosen))
    assert b"".join(bytes(s.tolist()) for s in reader) == expected


@pytest.mark.parametrize(("quota", "error", "message"), [
    (31, QuotaTooLarge, "exceeds submdat 'a''s 30 documents"),
    ("1G", QuotaTooLarge, "bytes of text"),
    (0, QuotaError, "not a document count"),
    (1.5, QuotaError, "fraction"),
    ("lots", QuotaError, "size of text"),
    (True, QuotaError, "document count"),
])
def test_bad_quotas(mdat, quota, error, message) -> None:
    with pytest.raises(error, match=message):
        mdat.create_view("bad", {"a": quota})
    assert "bad" not in [v.name for v in mdat.views()]


def test_view_names(mdat) -> None:
    with pytest.raises(InvalidName, match=r"view of everything"):
        mdat.create_view("default", {"a": 1})
    mdat.create_view("taken", {"a": 1})
    with pytest.raises(NameTaken, match=r"exists already"):
        mdat.create_view("taken", {"a": 2})
    with pytest.raises(UnknownName, match=r"'nope'.*default"):
        mdat.sequences("s", 64, view="nope")
    with pytest.raises(UnknownName, match=r"submdat 'zzz'"):
        mdat.create_view("other", {"zzz": 1})


def test_shuffle_is_a_deterministic_permutation_file(mdat) -> None:
    order = mdat.shuffle(None, "s", 128, seed=5)
    count = len(mdat.sequences("s", 128))
    assert order.dtype == np.uint32 and sorted(order.tolist()) == list(range(count))
    assert np.array_equal(np.load(mdat.path / "shuffling" / "default.s.128.seed5.npy"), order)
    assert np.array_equal(mdat.shuffle(None, "s", 128, seed=5), order)
    assert not np.array_equal(mdat.shuffle(None, "s", 128, seed=6), order)
    assert {s.name for s in mdat.shuffles()} >= {"default.s.128.seed5", "default.s.128.seed6"}


def test_shards_of_a_view_shuffle_are_disjoint_covering_and_proportional(mdat) -> None:
    mdat.create_view("sharded", {"a": 0.5, "b": 8}, seed=4)
    count = len(mdat.sequences("s", 64, view="sharded"))
    order = mdat.shuffle("sharded", "s", 64, seed=2)
    shares = [("big", 3.0), ("small", 1.0), ("mid", 2.0)]
    handed_out = []
    for round_index in range(-(-count // 40)):
        ids = order[round_index * 40:(round_index + 1) * 40]
        shards = assign(ids, shares)
        for client, share in shares:
            assert abs(len(shards[client]) - len(ids) * share / 6) < 1
            assert np.array_equal(shards[client], assign(ids, shares)[client])
        handed_out.extend(np.concatenate(list(shards.values())).tolist())
    assert len(handed_out) == count  # disjoint: no id twice ...
    assert sorted(handed_out) == list(range(count))  # ... and covering every sequence id
