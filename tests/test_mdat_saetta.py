"""Saetta export: flat files equal the shuffled view, written atomically."""

import json

import numpy as np
import pytest

from matformer.modeling.corpus import python_docs
from matformer.modeling.errors import SaettaError
from matformer.modeling.mdat import Mdat, SaettaReader, export_saetta


@pytest.fixture(scope="module")
def mdat(tmp_path_factory):
    with Mdat.create(tmp_path_factory.mktemp("saetta") / "c") as mdat:
        mdat.add_records("a", ({"text": t} for t in python_docs(limit=30)))
        mdat.add_strategy({"strategy_name": "s", "chunk_size": 64})
        mdat.pretokenize("s")
        yield mdat


def test_export_equals_the_shuffled_view(mdat, tmp_path) -> None:
    reader = mdat.sequences("s", 128)
    order = mdat.shuffle(None, "s", 128, seed=1)
    out = export_saetta(reader, order, tmp_path / "flat", seed=1)
    assert sorted(p.name for p in out.iterdir()) == ["offsets.npy", "saetta.json", "tokens.npy"]
    saetta = SaettaReader(out)
    assert len(saetta) == len(reader)
    for i in (0, 7, len(order) - 1, -1):
        assert np.array_equal(saetta[i], reader[int(order[i])])
    assert [s.tolist() for s in saetta] == [reader[int(i)].tolist() for i in order]
    tokens = np.load(out / "tokens.npy", mmap_mode="r")
    assert tokens.dtype == np.uint16 and len(tokens) == sum(len(s) for s in reader)
    manifest = json.loads((out / "saetta.json").read_text())
    assert (manifest["sequences"], manifest["max_seq_len"]) == (len(reader), 128)
    assert (manifest["view"], manifest["seed"]) == ("default", 1)
    assert manifest["fingerprint"] == mdat.fingerprint("s", 128)
    with pytest.raises(IndexError):
        saetta[len(saetta)]


def test_a_shard_of_the_order_exports_alone(mdat, tmp_path) -> None:
    reader = mdat.sequences("s", 64)
    ids = [5, 2, 9]
    saetta = SaettaReader(export_saetta(reader, ids, tmp_path / "shard"))
    assert [s.tolist() for s in saetta] == [reader[i].tolist() for i in ids]


def test_failed_export_leaves_nothing(mdat, tmp_path) -> None:
    reader = mdat.sequences("s", 64)
    with pytest.raises(IndexError):
        export_saetta(reader, [0, 1, len(reader)], tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_existing_or_broken_folders_raise(mdat, tmp_path) -> None:
    reader = mdat.sequences("s", 64)
    out = export_saetta(reader, [0, 1], tmp_path / "out")
    with pytest.raises(SaettaError, match=r"exists already"):
        export_saetta(reader, [0], out)
    (out / "offsets.npy").unlink()
    with pytest.raises(SaettaError, match=r"not a complete saetta folder.*export-saetta"):
        SaettaReader(out)
