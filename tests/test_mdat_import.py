"""Importing JSONL, folders and dicts: data and metadata apart, bad input, resume."""

import gc
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import lmdb
import numpy as np
import pytest

from matformer.modeling.errors import (
    BadRecord,
    EmptyDocument,
    MdatCorrupt,
    NameTaken,
    NotUtf8,
    ResumeMismatch,
    SourceNotFound,
    SubmdatIncomplete,
)
from matformer.modeling.mdat import Mdat
from matformer.modeling.mdat.lmdb_files import document_key
from matformer.modeling.mdat.npy_files import AppendableNpy

REPO = Path(__file__).resolve().parents[1]


def numbered(count: int) -> list[dict]:
    return [{"text": f"document {i} " * (i % 7 + 1), "n": i} for i in range(count)]


def write_jsonl(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def raw_lmdb(path: Path) -> dict[bytes, bytes]:
    env = lmdb.open(str(path), subdir=False, readonly=True, lock=False)
    with env.begin() as txn:
        items = dict(txn.cursor())
    env.close()
    return items


def test_jsonl_text_and_metadata_go_to_separate_lmdbs(tmp_path) -> None:
    records = [{"text": "first doc", "url": "a", "tags": [1, 2]}, {"text": "second", "url": "b"}]
    file = write_jsonl(tmp_path / "in.jsonl", [json.dumps(r).encode() for r in records])
    with Mdat.create(tmp_path / "c") as mdat:
        info = mdat.add_jsonl("web", file)
        assert (info.documents, info.raw_bytes, info.complete) == (2, 15, True)
        assert info.source == str(file)
        web = mdat.submdat("web")
        assert [web.text(0), web.text(1)] == ["first doc", "second"]
        assert web.metadata(0) == {"url": "a", "tags": [1, 2]}
        assert web.sizes.tolist() == [9, 6]
        web.close()  # LMDB opens a file once per process; raw_lmdb opens it again
    folder = tmp_path / "c" / "datasets" / "web"
    assert raw_lmdb(folder / "data.db") == {document_key(0): b"first doc",
                                            document_key(1): b"second"}
    meta = raw_lmdb(folder / "meta.db")
    assert json.loads(meta[document_key(1)]) == {"url": "b"}
    assert document_key(1) == b"\x00" * 7 + b"\x01"  # big-endian: byte order = document order


def test_text_field_option_and_records_without_metadata(tmp_path) -> None:
    file = write_jsonl(tmp_path / "in.jsonl", [b'{"body": "only text"}'])
    with Mdat.create(tmp_path / "c") as mdat:
        mdat.add_jsonl("x", file, text_field="body")
        assert mdat.submdat("x").text(0) == "only text"
        assert mdat.submdat("x").metadata(0) == {}
    assert raw_lmdb(tmp_path / "c" / "datasets" / "x" / "meta.db") == {}


def test_zstd_compression_round_trips_and_shrinks(tmp_path) -> None:
    text = "the same sentence again. " * 200
    with Mdat.create(tmp_path / "c") as mdat:
        info = mdat.add_records("z", [{"text": text}], compress=True)
        assert info.compression == "zstd"
        assert info.stored_bytes < info.raw_bytes // 10
        assert mdat.submdat("z").text(0) == text
    stored = raw_lmdb(tmp_path / "c" / "datasets" / "z" / "data.db")[document_key(0)]
    assert stored[:4] == b"\x28\xb5\x2f\xfd"  # the zstd frame magic


def test_folder_import_one_document_per_file(tmp_path) -> None:
    source = tmp_path / "texts"
    (source / "sub").mkdir(parents=True)
    (source / "b.txt").write_text("bee")
    (source / "a.txt").write_text("ay")
    (source / "sub" / "c.txt").write_text("sea")
    (source / "skip.md").write_text("not matched")
    with Mdat.create(tmp_path / "c") as mdat:
        info = mdat.add_folder("files", source)
        files = mdat.submdat("files")
        assert info.documents == 3
        assert [files.text(i) for i in range(3)] == ["ay", "bee", "sea"]
        assert files.metadata(2) == {"path": "sub/c.txt"}


def test_bad_json_line_names_file_and_line_or_is_skipped(tmp_path) -> None:
    file = write_jsonl(tmp_path / "in.jsonl", [b'{"text": "ok"}', b"", b'{"text": broken', b"[1]"])
    with Mdat.create(tmp_path / "c") as mdat:
        with pytest.raises(BadRecord, match=rf"{file}:3: not JSON.*skip_bad=True"):
            mdat.add_jsonl("a", file)
        info = mdat.add_jsonl("a", file, skip_bad=True)  # resumes the interrupted import
        assert (info.documents, info.skipped_invalid, info.records_read) == (1, 2, 3)


def test_not_utf8_line_names_file_and_line_or_is_skipped(tmp_path) -> None:
    file = write_jsonl(tmp_path / "in.jsonl", [b'{"text": "ok"}', b'{"text": "caf\xe9"}'])
    with Mdat.create(tmp_path / "c") as mdat:
        with pytest.raises(NotUtf8, match=rf"{file}:2: line is not valid UTF-8"):
            mdat.add_jsonl("a", file)
        info = mdat.add_jsonl("b", file, skip_bad=True)
        assert (info.documents, info.skipped_not_utf8) == (1, 1)


def test_not_utf8_file_and_lone_surrogate(tmp_path) -> None:
    source = tmp_path / "texts"
    source.mkdir()
    (source / "bad.txt").write_bytes(b"\xff\xfe")
    with Mdat.create(tmp_path / "c") as mdat:
        with pytest.raises(NotUtf8, match=r"bad.txt"):
            mdat.add_folder("f", source)
        with pytest.raises(NotUtf8, match=r"record 1"):
            mdat.add_records("d", [{"text": "fine"}, {"text": "\ud800"}])


def test_missing_text_field_is_a_bad_record(tmp_path) -> None:
    with Mdat.create(tmp_path / "c") as mdat:
        with pytest.raises(BadRecord, match=r"record 0: no text field 'text'.*fields: body"):
            mdat.add_records("d", [{"body": "x"}])
        with pytest.raises(BadRecord, match=r"record 0 is a str"):
            mdat.add_records("e", ["just a string"])


def test_empty_documents_stop_the_import_or_are_skipped_and_counted(tmp_path) -> None:
    file = write_jsonl(tmp_path / "in.jsonl", [b'{"text": "ok"}', b'{"text": "  "}'])
    with Mdat.create(tmp_path / "c") as mdat:
        with pytest.raises(EmptyDocument, match=r"record 2: the text is empty.*skip_bad=True"):
            mdat.add_records("d", [{"text": "real"}, {"text": "more"}, {"text": ""}])
        with pytest.raises(EmptyDocument, match=rf"{file}:2: the text is empty"):
            mdat.add_jsonl("j", file)
        info = mdat.add_records("e", [{"text": ""}, {"text": "real"}, {"text": " \n\t"}],
                                skip_bad=True)
        assert (info.documents, info.skipped_empty, info.records_read) == (1, 2, 3)
        assert mdat.submdat("e").sizes.tolist() == [4]


def test_missing_sources_are_named_errors(tmp_path) -> None:
    with Mdat.create(tmp_path / "c") as mdat:
        with pytest.raises(SourceNotFound, match=r"nowhere.jsonl does not exist"):
            mdat.add_jsonl("j", tmp_path / "nowhere.jsonl")
        with pytest.raises(SourceNotFound, match=r"folder .*nowhere does not exist"):
            mdat.add_folder("f", tmp_path / "nowhere")
        assert mdat.submdats() == []


def test_complete_submdat_is_not_imported_twice(tmp_path) -> None:
    with Mdat.create(tmp_path / "c") as mdat:
        mdat.add_records("d", [{"text": "x"}])
        with pytest.raises(NameTaken, match=r"exists already"):
            mdat.add_records("d", [{"text": "y"}])


def interrupted(records: list[dict], after: int):
    for i, record in enumerate(records):
        if i == after:
            raise RuntimeError("source went away")
        yield record


def contents(mdat: Mdat, name: str) -> tuple:
    submdat = mdat.submdat(name)
    texts = [submdat.text(i) for i in range(len(submdat))]
    metadata = [submdat.metadata(i) for i in range(len(submdat))]
    return texts, metadata, submdat.sizes.tolist()


def test_interrupted_import_is_readable_and_resumes_identically(tmp_path) -> None:
    records = numbered(57)
    with Mdat.create(tmp_path / "c") as mdat, pytest.raises(RuntimeError, match=r"went away"):
        mdat.add_records("d", interrupted(records, 25), batch_size=10)
    with Mdat.open(tmp_path / "c") as mdat:
        (info,) = mdat.submdats()
        assert (info.complete, info.documents, info.records_read) == (False, 20, 20)
        assert mdat.submdat("d").text(19) == records[19]["text"]
        mdat.add_strategy({"strategy_name": "b", "chunk_size": 8})
        with pytest.raises(SubmdatIncomplete, match=r"run the same add again"):
            mdat.pretokenize("b", submdats=["d"])
        with pytest.raises(ResumeMismatch, match=r"resume it with exactly those"):
            mdat.add_records("d", records, text_field="body")
        info = mdat.add_records("d", records, batch_size=10)
        assert (info.complete, info.documents, info.records_read) == (True, 57, 57)
        resumed = contents(mdat, "d")
    with Mdat.create(tmp_path / "fresh") as fresh:
        fresh.add_records("d", records, batch_size=7)
        assert contents(fresh, "d") == resumed


def test_resume_refuses_other_records(tmp_path) -> None:
    records = numbered(57)
    with Mdat.create(tmp_path / "c") as mdat:
        with pytest.raises(RuntimeError, match=r"went away"):
            mdat.add_records("d", interrupted(records, 25), batch_size=10)
        others = [*records[:5], {"text": "not what was imported"}, *records[6:]]
        with pytest.raises(ResumeMismatch, match=r"after 20 records.*does not start with the "
                                                 r"same records.*remove"):
            mdat.add_records("d", others, batch_size=10)
        with pytest.raises(ResumeMismatch, match=r"same records"):
            mdat.add_records("d", records[:15], batch_size=10)  # shorter than what was read
        assert mdat.add_records("d", records, batch_size=10).documents == 57


def test_folder_resume_refuses_a_changed_folder(tmp_path) -> None:
    source = tmp_path / "texts"
    source.mkdir()
    for i in range(6):
        (source / f"{i}.txt").write_text(f"file {i}")
    (source / "3.txt").write_bytes(b"\xff")  # stops the first import after file 2
    with Mdat.create(tmp_path / "c") as mdat:
        with pytest.raises(NotUtf8):
            mdat.add_folder("f", source, batch_size=1)
        assert mdat.submdats()[0].records_read == 3
        (source / "1.txt").unlink()  # a file count alone would not notice
        (source / "3.txt").write_text("file 3")
        with pytest.raises(ResumeMismatch, match=r"after 3 records"):
            mdat.add_folder("f", source, batch_size=1)


def test_sizes_longer_than_the_catalogue_after_a_crash(tmp_path) -> None:
    records = numbered(57)
    with Mdat.create(tmp_path / "c") as mdat, pytest.raises(RuntimeError, match=r"went away"):
        mdat.add_records("d", interrupted(records, 25), batch_size=10)
    # The crash window: sizes.npy of the next batch committed, its catalogue row not yet.
    sizes = AppendableNpy(tmp_path / "c" / "datasets" / "d" / "sizes.npy", np.uint64, 20)
    sizes.append(np.full(10, 99, dtype=np.uint64))
    sizes.commit()
    sizes.close()
    with Mdat.open(tmp_path / "c") as mdat:
        d = mdat.submdat("d")
        assert len(d.sizes) == 20 and d.text(19) == records[19]["text"]
        d.close()
        mdat.add_records("d", records, batch_size=10)
        resumed = contents(mdat, "d")
    with Mdat.create(tmp_path / "fresh") as fresh:
        fresh.add_records("d", records)
        assert contents(fresh, "d") == resumed


def open_descriptors() -> int:
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("damage", ["meta.db", "sizes.npy"])
def test_a_writer_that_cannot_open_a_file_leaks_none(tmp_path, damage) -> None:
    with Mdat.create(tmp_path / "c") as mdat:
        with pytest.raises(RuntimeError, match=r"went away"):
            mdat.add_records("d", interrupted(numbered(30), 25), batch_size=10)
        path = tmp_path / "c" / "datasets" / "d" / damage
        if damage == "meta.db":
            path.write_bytes(b"x" * 8192)
        else:
            os.truncate(path, 128 + 8 * 5)
        before = open_descriptors()
        for _ in range(3):
            with pytest.raises(MdatCorrupt, match=damage):
                mdat.add_records("d", numbered(30), batch_size=10)
        assert open_descriptors() == before


SLOW_IMPORT = """
import sys, time
from matformer.modeling.mdat import Mdat
records = [{"text": f"document {i} " * (i % 7 + 1), "n": i} for i in range(100_000)]
def slow():
    for record in records:
        time.sleep(0.002)
        yield record
Mdat.open(sys.argv[1]).add_records("d", slow(), batch_size=10, source="numbered")
"""


def test_killed_import_process_leaves_a_readable_resumable_container(tmp_path) -> None:
    Mdat.create(tmp_path / "c").close()
    script = tmp_path / "slow_import.py"
    script.write_text(textwrap.dedent(SLOW_IMPORT))
    process = subprocess.Popen([sys.executable, str(script), str(tmp_path / "c")], cwd=REPO,
                               env={**os.environ, "PYTHONPATH": str(REPO)})
    catalogue = sqlite3.connect(tmp_path / "c" / "mdat.db")
    deadline = time.monotonic() + 60
    committed = 0
    while committed < 30 and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
        row = catalogue.execute("SELECT documents FROM submdats").fetchone()
        committed = row[0] if row else 0
    process.send_signal(signal.SIGKILL)
    process.wait()
    catalogue.close()
    assert committed >= 30, "the import never got going"
    records = numbered(300)
    with Mdat.open(tmp_path / "c") as mdat:
        (info,) = mdat.submdats()
        assert not info.complete and info.documents % 10 == 0 and info.documents >= 30
        killed_at = info.documents
        assert mdat.submdat("d").text(killed_at - 1) == records[killed_at - 1]["text"]
        info = mdat.add_records("d", records, batch_size=10, source="numbered")
        assert (info.complete, info.documents) == (True, 300)
        resumed = contents(mdat, "d")
    with Mdat.create(tmp_path / "fresh") as fresh:
        fresh.add_records("d", records)
        assert contents(fresh, "d") == resumed
    assert np.load(tmp_path / "c" / "datasets" / "d" / "sizes.npy").shape == (300,)
