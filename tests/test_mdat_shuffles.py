"""Shuffles keep the fingerprint of the data they permute, and refuse data that moved on."""

import json

import numpy as np
import pytest

from matformer.modeling.errors import StaleShuffle, UnknownName
from matformer.modeling.mdat import Mdat

TEXTS = [f"Document {i}. " + "words and more words. " * (i % 5 + 1) for i in range(30)]


def build(path) -> Mdat:
    mdat = Mdat.create(path)
    mdat.add_records("a", ({"text": t} for t in TEXTS[:20]))
    mdat.add_records("b", ({"text": t} for t in TEXTS[20:]))
    mdat.add_strategy({"strategy_name": "s", "chunk_size": 16})
    mdat.pretokenize("s")
    return mdat


def test_shuffle_is_stored_with_its_fingerprint_and_given_back(tmp_path) -> None:
    with build(tmp_path / "c") as mdat:
        order = mdat.shuffle(None, "s", 32, seed=3)
        (info,) = mdat.shuffles()
        assert info.fingerprint == mdat.fingerprint("s", 32) == mdat.sequences("s", 32).fingerprint
        assert np.array_equal(mdat.shuffle(None, "s", 32, seed=3), order)
        assert np.array_equal(mdat.load_shuffle(None, "s", 32, seed=3), order)
        with pytest.raises(UnknownName, match=r"shuffle 'default.s.32.seed4'"):
            mdat.load_shuffle(None, "s", 32, seed=4)


def test_a_new_submdat_makes_default_shuffles_stale(tmp_path) -> None:
    with build(tmp_path / "c") as mdat:
        mdat.create_view("only_a", {"a": 5})
        order = mdat.shuffle(None, "s", 32, seed=0)
        view_order = mdat.shuffle("only_a", "s", 32, seed=0)
        stored = (mdat.path / "shuffling" / "default.s.32.seed0.npy").read_bytes()
        mdat.add_records("c", [{"text": "a new document"}])
        mdat.pretokenize("s")
        for call in (mdat.load_shuffle, mdat.shuffle):
            with pytest.raises(StaleShuffle, match=r"'default.s.32.seed0'.*submdats.c.id: absent "
                                                   r"→ 3.*new seed"):
                call(None, "s", 32, 0)
        assert (mdat.path / "shuffling" / "default.s.32.seed0.npy").read_bytes() == stored
        assert len(mdat.shuffle(None, "s", 32, seed=1)) > len(order)
        # A named view holds the same documents as before: its shuffle is still good.
        assert np.array_equal(mdat.load_shuffle("only_a", "s", 32, 0), view_order)


def test_fingerprint_covers_the_data_and_only_the_data(tmp_path) -> None:
    with build(tmp_path / "one") as one, build(tmp_path / "two") as two:
        assert one.fingerprint("s", 32) == two.fingerprint("s", 32)  # another folder, same data
        one.create_view("v", {"a": 5}, seed=1)
        two.create_view("v", {"a": 5}, seed=2)  # as many documents, other ones
        assert one.fingerprint("s", 32, "v") != two.fingerprint("s", 32, "v")
        assert len({one.fingerprint("s", 32), one.fingerprint("s", 64),
                    one.fingerprint("s", 32, "v")}) == 3
        one.add_strategy({"strategy_name": "t", "chunk_size": 16,
                          "splitter_class": "sentence_chunks"})
        one.pretokenize("t")
        assert one.fingerprint("t", 32) != one.fingerprint("s", 32)
        one.shuffle("v", "s", 32, seed=0)
        (info,) = one.shuffles()
        assert json.loads(info.dataset)["submdats"]["a"]["selection"].startswith(
            "5 documents, sha256 ")


def test_two_processes_making_the_same_shuffle_at_once_both_get_it(tmp_path) -> None:
    """Ranks of one torchrun (or two clients on one file) may both find the shuffle missing
    and make it: the second record is the first one's twin and stands aside; a record that
    describes other data is refused by name."""
    import dataclasses

    from matformer.modeling.errors import MdatError

    build(tmp_path / "c").close()
    with Mdat.open(tmp_path / "c") as first, Mdat.open(tmp_path / "c") as second:
        order = first.shuffle(None, "s", 32, seed=5)
        (info,) = first.shuffles()
        second._catalogue.add_shuffle(info)  # what the slower process does after writing
        assert np.array_equal(second.shuffle(None, "s", 32, seed=5), order)
        other = dataclasses.replace(info, fingerprint="0" * len(info.fingerprint))
        with pytest.raises(MdatError, match="recorded meanwhile for other data"):
            second._catalogue.add_shuffle(other)
