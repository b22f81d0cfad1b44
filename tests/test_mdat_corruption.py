"""Damaged files raise MdatCorrupt naming the file and the fix, never crash the process."""

import gc
import os
import subprocess
import sys
from pathlib import Path

import lmdb
import numpy as np
import pytest

from matformer.modeling.errors import MdatCorrupt
from matformer.modeling.mdat import Mdat
from matformer.modeling.mdat.lmdb_files import document_key

REPO = Path(__file__).resolve().parents[1]
TEXTS = [f"document number {i}. " * (20 + i) for i in range(400)]


@pytest.fixture
def mdat(tmp_path):
    with Mdat.create(tmp_path / "c") as mdat:
        mdat.add_records("plain", ({"text": t, "i": i} for i, t in enumerate(TEXTS)))
        mdat.add_records("packed", ({"text": t} for t in TEXTS[:5]), compress=True)
        mdat.add_records("intact", [{"text": "still fine"}])
        yield mdat


def data_file(mdat: Mdat, name: str, file: str = "data.db") -> Path:
    return mdat.path / "datasets" / name / file


def put_raw(path: Path, key: bytes, value: bytes | None) -> None:
    env = lmdb.open(str(path), subdir=False)
    with env.begin(write=True) as txn:
        txn.put(key, value) if value is not None else txn.delete(key)
    env.close()


def still_consistent(mdat: Mdat) -> None:
    assert [info.name for info in mdat.submdats()] == ["plain", "packed", "intact"]
    assert mdat.submdat("intact").text(0) == "still fine"


def test_truncated_lmdb_file(mdat) -> None:
    path = data_file(mdat, "plain")
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(MdatCorrupt, match=rf"{path} is damaged.*LMDB uses.*import the source "
                                          "again"):
        mdat.submdat("plain")
    still_consistent(mdat)


def test_a_file_refused_on_opening_stays_closed(mdat) -> None:
    path = data_file(mdat, "plain")
    intact = path.read_bytes()
    os.truncate(path, path.stat().st_size // 2)
    gc.collect()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(MdatCorrupt, match=r"LMDB uses"):
            mdat.submdat("plain")
    assert len(os.listdir("/proc/self/fd")) == before
    path.write_bytes(intact)  # put back: read through a fresh environment, not a stale one
    assert mdat.submdat("plain").text(399) == TEXTS[399]


def test_damaged_catalogue(tmp_path) -> None:
    Mdat.create(tmp_path / "c").close()
    catalogue = tmp_path / "c" / "mdat.db"
    catalogue.write_bytes(b"not a database" * 500)
    with pytest.raises(MdatCorrupt, match=rf"{catalogue} cannot be read as an MDAT catalogue "
                                          r".*backup"):
        Mdat.open(tmp_path / "c")


def test_file_cut_below_lmdb_meta_pages(mdat) -> None:
    path = data_file(mdat, "plain", "meta.db")
    os.truncate(path, 100)
    with pytest.raises(MdatCorrupt, match=r"only 100 bytes"):
        mdat.submdat("plain")


def test_garbage_header(mdat) -> None:
    path = data_file(mdat, "plain")
    with open(path, "r+b") as file:
        file.write(b"x" * 8192)
    with pytest.raises(MdatCorrupt, match=r"not an LMDB file"):
        mdat.submdat("plain")
    still_consistent(mdat)


def test_missing_file(mdat) -> None:
    data_file(mdat, "plain").unlink()
    with pytest.raises(MdatCorrupt, match=r"damaged or missing"):
        mdat.submdat("plain")


def test_damaged_values(mdat) -> None:
    put_raw(data_file(mdat, "packed"), document_key(1), b"\x28\xb5\x2f\xfd garbage")
    put_raw(data_file(mdat, "plain"), document_key(3), None)
    put_raw(data_file(mdat, "plain", "meta.db"), document_key(2), b"{not json")
    packed, plain = mdat.submdat("packed"), mdat.submdat("plain")
    assert packed.text(0) == TEXTS[0]
    with pytest.raises(MdatCorrupt, match=r"packed/data.db is damaged"):
        packed.text(1)
    with pytest.raises(MdatCorrupt, match=r"document 3 is missing"):
        plain.text(3)
    with pytest.raises(MdatCorrupt, match=r"meta.db is damaged"):
        plain.metadata(2)
    assert plain.metadata(1) == {"i": 1}


CHECK_IN_FRESH_PROCESS = """
import sys
from matformer.modeling.errors import MdatCorrupt
from matformer.modeling.mdat import Mdat
for name in ("plain", "packed"):
    try:
        Mdat.open(sys.argv[1]).submdat(name).text(4)
    except MdatCorrupt as err:
        print("MdatCorrupt:", err)
"""


def test_a_fresh_process_gets_an_error_not_a_crash(mdat) -> None:
    truncated, garbled = data_file(mdat, "plain"), data_file(mdat, "packed")
    os.truncate(truncated, truncated.stat().st_size - 4096)
    with open(garbled, "r+b") as file:
        file.write(os.urandom(8192))
    result = subprocess.run(
        [sys.executable, "-c", CHECK_IN_FRESH_PROCESS, str(mdat.path)], cwd=REPO,
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(" ")[0] for line in lines] == ["MdatCorrupt:"] * 2
    assert str(truncated) in lines[0] and str(garbled) in lines[1]


def test_truncated_pretok_file_is_reported_then_rebuilt(mdat) -> None:
    mdat.add_strategy({"strategy_name": "s", "chunk_size": 32})
    mdat.pretokenize("s")
    before = [s.tolist() for s in mdat.sequences("s", 64)]
    tokens = mdat.path / "pretok" / "s" / "plain" / "tokens.npy"
    os.truncate(tokens, tokens.stat().st_size - 10)
    with pytest.raises(MdatCorrupt, match=r"tokens.npy cannot be read.*pretokenize with "
                                          r"strategy 's' again"):
        mdat.sequences("s", 64)
    mdat.pretokenize("s")
    assert [s.tolist() for s in mdat.sequences("s", 64)] == before
    assert np.load(tokens).dtype == np.uint16
