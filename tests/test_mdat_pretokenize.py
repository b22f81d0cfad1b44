"""Pretokenization: files on disk, worker processes, resuming after an interruption."""

import textwrap

import numpy as np
import pytest

from modeling.corpus import python_docs
from modeling.errors import SplitterError
from modeling.mdat import Mdat
from modeling.mdat.pretok_files import CHUNKS, DOC_CHUNKS, HISTOGRAM, TOKENS

DOCS = [f"{i:04d} {text}" for i, text in enumerate(python_docs(limit=60))]
FILES = (TOKENS, CHUNKS, DOC_CHUNKS, HISTOGRAM)

FLAKY_SPLITTER = '''
import os

from modeling.mdat.splitters import fixed_lengths
from modeling.registry import registry


@registry.register("splitter", "test_flaky_bytes", "default")
class FlakyBytes:
    """fixed_chunks, except that it fails on a document holding $MDAT_TEST_FAIL_ON."""

    def __init__(self, *, tokenizer, chunk_size):
        self.tokenizer, self.chunk_size = tokenizer, chunk_size

    def __call__(self, document):
        marker = os.environ.get("MDAT_TEST_FAIL_ON")
        if marker and marker in document["data"]:
            raise RuntimeError("interrupted")
        tokens, _ = self.tokenizer.encode(document["data"])
        return {"tokens": tokens, "chunks": fixed_lengths(len(tokens), self.chunk_size)}
'''


def container(path, splitter: str = "fixed_chunks", chunk_size: int = 64) -> Mdat:
    mdat = Mdat.create(path)
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


def test_files_hold_tokens_chunks_counts_and_histogram(tmp_path) -> None:
    with container(tmp_path / "c") as mdat:
        status = mdat.pretokenize("s", batch_size=16)
        assert [p.complete for p in status] == [True, True]
        folder = mdat.path / "pretok" / "s" / "first"
        tokens = np.load(folder / TOKENS)
        expected = b"".join(t.encode() for t in DOCS[:45])
        assert tokens.dtype == np.uint16 and tokens.tobytes() == np.frombuffer(
            expected, dtype=np.uint8).astype(np.uint16).tobytes()
        lengths = [len(t.encode()) for t in DOCS[:45]]
        doc_chunks = np.load(folder / DOC_CHUNKS)
        assert doc_chunks.tolist() == [-(-n // 64) for n in lengths]
        chunks = np.load(folder / CHUNKS)
        assert chunks.sum() == sum(lengths) and chunks.max() == 64
        histogram = np.load(folder / HISTOGRAM)
        assert histogram.tolist() == np.bincount(doc_chunks).tolist()
        assert status[0].tokens == sum(lengths) and status[0].chunks == len(chunks)


def test_two_processes_write_the_same_files_as_one(tmp_path) -> None:
    with container(tmp_path / "one") as one, container(tmp_path / "two") as two:
        one.pretokenize("s", processes=1, batch_size=8)
        two.pretokenize("s", processes=2, batch_size=8)
        assert pretok_bytes(one) == pretok_bytes(two)


def test_interrupted_pretokenization_resumes_to_identical_files(tmp_path, monkeypatch) -> None:
    with container(tmp_path / "fresh", "test_flaky_bytes") as fresh:
        fresh.pretokenize("s", batch_size=8)
        expected = pretok_bytes(fresh)
    with container(tmp_path / "c", "test_flaky_bytes") as mdat:
        monkeypatch.setenv("MDAT_TEST_FAIL_ON", "0037 ")
        with pytest.raises(SplitterError, match=r"document 37 of submdat 'first'.*resumes"):
            mdat.pretokenize("s", batch_size=8)
        first, second = mdat.pretok_status("s")
        assert (first.complete, first.documents, second.documents) == (False, 32, 0)
        # A batch half-written when the process died: bytes past the committed length.
        with open(mdat.path / "pretok" / "s" / "first" / TOKENS, "ab") as tokens:
            tokens.write(b"\xff" * 1000)
        monkeypatch.delenv("MDAT_TEST_FAIL_ON")
        mdat.pretokenize("s", batch_size=8)
        assert pretok_bytes(mdat) == expected


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
