"""Pretokenization: files on disk, worker processes, resuming after an interruption."""

import gc
import os
import resource
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from matformer.modeling.corpus import python_docs
from matformer.modeling.errors import SplitterError
from matformer.modeling.mdat import Mdat
from matformer.modeling.mdat.pretok_files import CHUNK_STARTS, DOC_STARTS, HISTOGRAM, TOKENS

REPO = Path(__file__).resolve().parents[1]
DOCS = [f"{i:04d} {text}" for i, text in enumerate(python_docs(limit=60))]
FILES = (TOKENS, CHUNK_STARTS, DOC_STARTS, HISTOGRAM)

FLAKY_SPLITTER = '''
import os
import time

from matformer.modeling.mdat.builtin_splitters import fixed_lengths
from matformer.modeling.registry import registry


@registry.register("splitter", "test_flaky_bytes", "default")
class FlakyBytes:
    """fixed_chunks, but failing on a document holding $MDAT_TEST_FAIL_ON, and as slow as
    $MDAT_TEST_SLEEP seconds per document."""

    def __init__(self, *, tokenizer, chunk_size):
        self.tokenizer, self.chunk_size = tokenizer, chunk_size

    def __call__(self, document):
        marker = os.environ.get("MDAT_TEST_FAIL_ON")
        if marker and marker in document["data"]:
            raise RuntimeError("interrupted")
        time.sleep(float(os.environ.get("MDAT_TEST_SLEEP", "0")))
        tokens, _ = self.tokenizer.encode(document["data"])
        return {"tokens": tokens, "chunks": fixed_lengths(len(tokens), self.chunk_size)}
'''


def container(path, splitter: str = "fixed_chunks", chunk_size: int = 64) -> Mdat:
    mdat = Mdat.create(path, trust_remote_code=True)  # flaky.py is this test's own
    (mdat.path / "functions" / "flaky.py").write_text(textwrap.dedent(FLAKY_SPLITTER))
    mdat.add_records("first", ({"text": t} for t in DOCS[:45]))
    mdat.add_records("second", ({"text": t} for t in DOCS[45:]))
    mdat.add_strategy({"strategy_name": "s", "chunk_size": chunk_size,
                       "splitter_class": splitter})
    return mdat


def pretok_bytes(mdat: Mdat) -> dict[str, bytes]:
    folder = mdat.path / "pretok" / "s"
    return {f"{sub}/{name}": (folder / sub / name).read_bytes()
            for sub in ("first", "second") for name in FILES}


def test_files_hold_tokens_offsets_and_histogram(tmp_path) -> None:
    with container(tmp_path / "c") as mdat:
        status = mdat.pretokenize("s", batch_size=16)
        assert [p.complete for p in status] == [True, True]
        folder = mdat.path / "pretok" / "s" / "first"
        tokens = np.load(folder / TOKENS)
        expected = b"".join(t.encode() for t in DOCS[:45])
        assert tokens.dtype == np.uint16 and tokens.tobytes() == np.frombuffer(
            expected, dtype=np.uint8).astype(np.uint16).tobytes()
        lengths = [len(t.encode()) for t in DOCS[:45]]
        doc_chunks = [-(-n // 64) for n in lengths]
        doc_starts = np.load(folder / DOC_STARTS)
        assert doc_starts.dtype == np.int64
        assert doc_starts.tolist() == np.cumsum([0, *doc_chunks]).tolist()
        chunk_starts = np.load(folder / CHUNK_STARTS)
        chunk_lengths = [min(64, n - c) for n in lengths for c in range(0, n, 64)]
        assert chunk_starts.tolist() == np.cumsum([0, *chunk_lengths]).tolist()
        histogram = np.load(folder / HISTOGRAM)
        assert histogram.tolist() == np.bincount(doc_chunks).tolist()
        assert status[0].tokens == sum(lengths) and status[0].chunks == len(chunk_lengths)


def test_two_processes_write_the_same_files_as_one(tmp_path) -> None:
    with container(tmp_path / "one") as one, container(tmp_path / "two") as two:
        one.pretokenize("s", processes=1, batch_size=8)
        two.pretokenize("s", processes=2, batch_size=8)
        assert pretok_bytes(one) == pretok_bytes(two)


@pytest.mark.parametrize("processes", [1, 2])
def test_interrupted_pretokenization_resumes_to_identical_files(tmp_path, monkeypatch,
                                                                processes) -> None:
    with container(tmp_path / "fresh", "test_flaky_bytes") as fresh:
        fresh.pretokenize("s", batch_size=8)
        expected = pretok_bytes(fresh)
    with container(tmp_path / "c", "test_flaky_bytes") as mdat:
        monkeypatch.setenv("MDAT_TEST_FAIL_ON", "0037 ")
        with pytest.raises(SplitterError, match=r"document 37 of submdat 'first'.*resumes"):
            mdat.pretokenize("s", batch_size=8, processes=processes)
        first, second = mdat.pretok_status("s")
        assert (first.complete, first.documents, second.documents) == (False, 32, 0)
        # A batch half-written when the process died: bytes past the committed length.
        with open(mdat.path / "pretok" / "s" / "first" / TOKENS, "ab") as tokens:
            tokens.write(b"\xff" * 1000)
        monkeypatch.delenv("MDAT_TEST_FAIL_ON")
        mdat.pretokenize("s", batch_size=8, processes=processes)
        assert pretok_bytes(mdat) == expected


SLOW_PRETOKENIZE = """
import sys
from matformer.modeling.mdat import Mdat
Mdat.open(sys.argv[1], trust_remote_code=True).pretokenize("s", batch_size=4,
                                                 processes=int(sys.argv[2]))
"""


def test_killed_pretokenization_resumes_to_identical_files(tmp_path) -> None:
    with container(tmp_path / "fresh", "test_flaky_bytes") as fresh:
        fresh.pretokenize("s")
        expected = pretok_bytes(fresh)
    container(tmp_path / "c", "test_flaky_bytes").close()
    process = subprocess.Popen(
        [sys.executable, "-c", SLOW_PRETOKENIZE, str(tmp_path / "c"), "2"], cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "MDAT_TEST_SLEEP": "0.03"},
        start_new_session=True,  # its workers too are killed, as a crash would kill them
    )
    catalogue = sqlite3.connect(tmp_path / "c" / "mdat.db")
    deadline = time.monotonic() + 60
    committed = 0
    while committed < 8 and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.02)
        (committed,) = catalogue.execute("SELECT TOTAL(documents) FROM pretok").fetchone()
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    catalogue.close()
    assert committed >= 8, "the pretokenization never got going"
    with Mdat.open(tmp_path / "c") as mdat:
        assert not all(p.complete for p in mdat.pretok_status("s"))
        mdat.pretokenize("s")
        assert pretok_bytes(mdat) == expected


def test_many_submdats_need_few_file_descriptors(tmp_path) -> None:
    with Mdat.create(tmp_path / "c") as mdat:
        for i in range(40):
            mdat.add_records(f"s{i}", [{"text": f"document {i}"}])
        mdat.add_strategy({"strategy_name": "s", "chunk_size": 8})
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        gc.collect()  # earlier tests' unreferenced readers let go of their files
        in_use = len(os.listdir("/proc/self/fd"))
        # 40 submdats x 3 files would not fit; one writer's files and one reader's do.
        resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 24, hard))
        try:
            mdat.pretokenize("s", batch_size=1)
        finally:
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        assert all(p.complete for p in mdat.pretok_status("s"))
        assert len(os.listdir("/proc/self/fd")) == in_use
        assert mdat.sequences("s", 16)[-1].tobytes() == np.frombuffer(
            b"document 39", np.uint8).astype(np.uint16).tobytes()


def test_complete_submdats_are_skipped(tmp_path) -> None:
    with container(tmp_path / "c") as mdat:
        mdat.pretokenize("s", submdats=["first"])
        assert [p.complete for p in mdat.pretok_status("s")] == [True, False]
        written = (mdat.path / "pretok" / "s" / "first" / TOKENS).stat().st_mtime_ns
        mdat.pretokenize("s")
        assert [p.complete for p in mdat.pretok_status("s")] == [True, True]
        assert (mdat.path / "pretok" / "s" / "first" / TOKENS).stat().st_mtime_ns == written


def test_pretokenize_while_a_reader_is_open(tmp_path) -> None:
    with container(tmp_path / "c") as mdat:
        reader = mdat.submdat("first")  # shares LMDB environments with the pretokenizer
        mdat.pretokenize("s")
        assert reader.text(3) == DOCS[3]
