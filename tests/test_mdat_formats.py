"""Parquet files and `datasets` datasets: the same container as the JSONL of the same records,
batch by batch and resumable, with bad rows named by file and row, and hub ids read offline."""

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from matformer.modeling.errors import (
    BadRecord,
    EmptyDocument,
    FormatUnavailable,
    MissingTextColumn,
    NotUtf8,
    ResumeMismatch,
    SourceNotFound,
    SplitError,
    UnreadableSource,
)
from matformer.modeling.mdat import Mdat, SubmdatInfo
from matformer.modeling.mdat import tables as tables_module
from matformer.modeling.mdat.submdat import SIZES_NAME
from matformer.scripts.mdat_cli import main

pa = pytest.importorskip("pyarrow", reason="pyarrow is missing: pip install 'matformer[formats]'")
pq = pytest.importorskip("pyarrow.parquet")

REPO = Path(__file__).resolve().parents[1]
TEXTS = [f"Dokument {i} – " + "wörd " * (i % 9 + 1) for i in range(45)]
SHA = "0123456789abcdef0123456789abcdef01234567"
# Every counter of an import; records_sha256 too: the same records hash the same in any format.
COUNTERS = ("complete", "compression", "records_read", "records_sha256", "documents",
            "raw_bytes", "stored_bytes", "skipped_empty", "skipped_invalid", "skipped_not_utf8")


def needs_datasets():
    return pytest.importorskip("datasets", reason="datasets is missing: pip install "
                               "'matformer[formats]'")


def write_parquet(path: Path, cells: list, row_group_size: int = 8, kind: str = "",
                  **columns) -> Path:
    """``cells`` as column "text" (of type ``kind``, else inferred), beside ``columns``."""
    text = pa.array(cells, pa.binary() if kind else None)
    if kind == "string":  # bytes viewed as a string: what a writer that never checks UTF-8 leaves
        text = text.view(pa.string())
    pq.write_table(pa.table({"text": text, **columns}), path, row_group_size=row_group_size)
    return path


def write_jsonl(path: Path, lines: list) -> Path:
    encoded = [line if isinstance(line, bytes) else json.dumps(line).encode() for line in lines]
    path.write_bytes(b"\n".join(encoded) + b"\n")
    return path


def counters(info: SubmdatInfo, leaving_out: str = "") -> dict:
    return {name: getattr(info, name) for name in COUNTERS if name != leaving_out}


def contents(mdat: Mdat, name: str) -> tuple:
    submdat = mdat.submdat(name)
    texts = [submdat.text(i) for i in range(len(submdat))]
    metadata = [submdat.metadata(i) for i in range(len(submdat))]
    return texts, metadata, submdat.sizes.tolist()


def pretokenized(mdat: Mdat) -> list[list[int]]:
    mdat.add_strategy({"strategy_name": "b", "chunk_size": 8})
    mdat.pretokenize("b")
    reader = mdat.sequences("b", 16)
    return [reader[i].tolist() for i in range(len(reader))]


def imported(path: Path, add) -> tuple:
    """(counters, contents, pretokenized sequences) of a new container filled by ``add``."""
    with Mdat.create(path) as mdat:
        info = add(mdat)
        return counters(info), contents(mdat, "d"), pretokenized(mdat)


def test_parquet_and_datasets_imports_equal_the_jsonl_import(tmp_path) -> None:
    datasets = needs_datasets()
    jsonl = write_jsonl(tmp_path / "in.jsonl", [{"text": t, "n": i} for i, t in enumerate(TEXTS)])
    # Two files, several row groups each; column "n" is each document's metadata in all three
    first = write_parquet(tmp_path / "a.parquet", TEXTS[:30], n=list(range(30)))
    second = write_parquet(tmp_path / "b.parquet", TEXTS[30:], row_group_size=4,
                           n=list(range(30, 45)))
    assert (pq.ParquetFile(first).num_row_groups, pq.ParquetFile(second).num_row_groups) == (4, 4)
    datasets.Dataset.from_dict({"text": TEXTS, "n": list(range(45))}).save_to_disk(
        tmp_path / "saved")

    expected = imported(tmp_path / "jsonl", lambda m: m.add_jsonl("d", jsonl, batch_size=7))
    assert expected[0]["documents"] == 45 and expected[1][1] == [{"n": i} for i in range(45)]
    assert imported(tmp_path / "parquet",
                    lambda m: m.add_parquet("d", [first, second], batch_size=7)) == expected
    assert imported(tmp_path / "datasets",
                    lambda m: m.add_hf_dataset("d", tmp_path / "saved", batch_size=7)) == expected


def test_parquet_is_read_a_batch_of_the_text_column_at_a_time(tmp_path, monkeypatch) -> None:
    file = write_parquet(tmp_path / "a.parquet", TEXTS, wide=["x" * 10_000] * 45)
    asked = []
    iter_batches = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        asked.append(kwargs)
        return iter_batches(self, *args, **kwargs)

    def whole_file(*args, **kwargs):
        raise AssertionError("a whole file was read")

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    for name in ("read", "read_row_groups", "read_row_group"):
        monkeypatch.setattr(pq.ParquetFile, name, whole_file)
    monkeypatch.setattr(pq, "read_table", whole_file)
    monkeypatch.setattr(tables_module, "ROWS_PER_READ", 5)
    with Mdat.create(tmp_path / "c") as mdat:
        assert mdat.add_parquet("d", file).documents == 45
        assert mdat.submdat("d").text(44) == TEXTS[44]
    assert asked == [{"batch_size": 5, "columns": ["text", "wide"]}]


def fail_after_batches(monkeypatch, count: int) -> None:
    """Reading Parquet fails after ``count`` batches, as a network drive that goes away."""
    iter_batches = pq.ParquetFile.iter_batches
    read = itertools.count()

    def failing(self, *args, **kwargs):
        for batch in iter_batches(self, *args, **kwargs):
            if next(read) == count:
                raise OSError("source went away")
            yield batch

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", failing)


def test_interrupted_parquet_import_resumes_to_an_identical_container(tmp_path,
                                                                      monkeypatch) -> None:
    first = write_parquet(tmp_path / "a.parquet", TEXTS[:30])
    second = write_parquet(tmp_path / "b.parquet", TEXTS[30:], row_group_size=4)
    monkeypatch.setattr(tables_module, "ROWS_PER_READ", 4)
    fail_after_batches(monkeypatch, 10)  # 8 batches of a.parquet, then 2 of b.parquet
    with Mdat.create(tmp_path / "c") as mdat, pytest.raises(
            UnreadableSource, match=rf"{second} could not be read to its end \(source went"):
        mdat.add_parquet("d", [first, second], batch_size=10)
    monkeypatch.undo()  # reading works again, in batches of another size
    with Mdat.open(tmp_path / "c") as mdat:
        (info,) = mdat.submdats()
        assert (info.complete, info.documents, info.records_read) == (False, 30, 30)
        assert mdat.submdat("d").text(29) == TEXTS[29]
        with pytest.raises(ResumeMismatch, match=r"resume it with exactly those"):
            mdat.add_parquet("d", [second, first], batch_size=10)
        write_parquet(first, [*TEXTS[:5], "another fifth row", *TEXTS[6:30]])
        with pytest.raises(ResumeMismatch, match=r"after 30 records.*does not start with"):
            mdat.add_parquet("d", [first, second], batch_size=10)
        write_parquet(first, TEXTS[:30])
        resumed = mdat.add_parquet("d", [first, second], batch_size=10)
        assert (resumed.complete, resumed.documents) == (True, 45)
        resumed_contents = contents(mdat, "d")
    with Mdat.create(tmp_path / "fresh") as fresh:
        info = fresh.add_parquet("d", [first, second], batch_size=7)
        assert counters(info) == counters(resumed) and info.source == resumed.source
        assert contents(fresh, "d") == resumed_contents
    sizes = [(path / "datasets" / "d" / SIZES_NAME).read_bytes()
             for path in (tmp_path / "c", tmp_path / "fresh")]
    assert sizes[0] == sizes[1]


BAD_CELLS = [  # (cell, what it raises, its message)
    (None, BadRecord, "the text column 'text' is null"),
    (b"", EmptyDocument, "the text is empty"),
    (b" \n", EmptyDocument, "the text is empty"),
    (b"caf\xe9", NotUtf8, "text is not valid UTF-8"),
]


@pytest.mark.parametrize("kind", ["string", "binary"])
def test_bad_rows_are_named_by_file_and_row_or_skipped_and_counted_like_jsonl(tmp_path,
                                                                             kind) -> None:
    with Mdat.create(tmp_path / "c") as mdat:
        for number, (cell, error, message) in enumerate(BAD_CELLS):
            file = write_parquet(tmp_path / f"bad{number}.parquet", [b"ok", cell], kind=kind)
            with pytest.raises(error, match=rf"{file} row 1: {message}.*skip_bad=True"):
                mdat.add_parquet(f"p{number}", file)
        cells = [b"ok", *(cell for cell, _, _ in BAD_CELLS), b"fine"]
        file = write_parquet(tmp_path / "bad.parquet", cells, row_group_size=2, kind=kind)
        with pytest.raises(BadRecord, match=rf"{file} row 1"):
            mdat.add_parquet("p", file)
        info = mdat.add_parquet("p", file, skip_bad=True)  # resumes the interrupted import
        lines = [{"text": "ok"}, {"text": None}, {"text": ""}, {"text": " \n"},
                 b'{"text": "caf\xe9"}', {"text": "fine"}]
        like = mdat.add_jsonl("j", write_jsonl(tmp_path / "bad.jsonl", lines), skip_bad=True)
        assert (info.documents, info.skipped_invalid, info.skipped_empty,
                info.skipped_not_utf8) == (2, 1, 2, 1)
        # Bad records name their file, so only their hash differs.
        assert counters(info, "records_sha256") == counters(like, "records_sha256")
        assert contents(mdat, "p") == contents(mdat, "j")


def test_wrong_files_and_columns_are_named_before_anything_is_imported(tmp_path) -> None:
    file = write_parquet(tmp_path / "a.parquet", TEXTS[:3], body=["x"] * 3)
    numbers = write_parquet(tmp_path / "n.parquet", [1, 2])
    (tmp_path / "not.parquet").write_text("plain text")
    with Mdat.create(tmp_path / "c") as mdat:
        with pytest.raises(MissingTextColumn, match=rf"{file} has no column 'tx' \(columns: "
                                                    r"text, body\).*--text-field"):
            mdat.add_parquet("d", [file], text_field="tx")
        with pytest.raises(UnreadableSource, match=r"not.parquet cannot be read as Parquet"):
            mdat.add_parquet("d", [file, tmp_path / "not.parquet"])
        with pytest.raises(SourceNotFound, match=r"Parquet file .*missing.parquet does not"):
            mdat.add_parquet("d", tmp_path / "missing.parquet")
        with pytest.raises(SourceNotFound, match=r"no Parquet file given"):
            mdat.add_parquet("d", [])
        with pytest.raises(MissingTextColumn, match=rf"{numbers} column 'text' holds int64, "
                                                    r"not text"):
            mdat.add_parquet("n", numbers)
        assert mdat.submdats() == []
        data = file.read_bytes()  # "PAR1", the column chunks, the footer, its length, "PAR1"
        pages = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
        file.write_bytes(data[:4] + b"\xff" * (pages - 4) + data[pages:])
        with pytest.raises(UnreadableSource, match=rf"{file} row group 0: no readable page "
                                                   r"header at byte 4"):
            mdat.add_parquet("e", file)
        assert mdat.submdats() == []


def test_missing_packages_name_the_pip_command(tmp_path, monkeypatch) -> None:
    file = write_parquet(tmp_path / "a.parquet", TEXTS[:3])
    (tmp_path / "saved").mkdir()
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with Mdat.create(tmp_path / "c") as mdat:
        with pytest.raises(FormatUnavailable, match=r"Parquet files needs the pyarrow package"
                                                    r".*pip install 'matformer\[formats\]'"):
            mdat.add_parquet("d", file)
        with pytest.raises(FormatUnavailable, match=r"save_to_disk needs the pyarrow package"
                                                    r".*pip install 'matformer\[formats\]'"):
            mdat.add_hf_dataset("d", tmp_path / "saved")
        with pytest.raises(FormatUnavailable, match=r"needs the datasets package.*"
                                                    r"pip install 'matformer\[formats\]'"):
            mdat.add_hf_dataset("d", "org/tiny")
        assert mdat.submdats() == []


def test_saved_dataset_dict_needs_a_split_and_a_resume_the_same_one(tmp_path) -> None:
    datasets = needs_datasets()
    saved = tmp_path / "saved"
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": [*TEXTS[:10], None, *TEXTS[10:20]]}),
        "test": datasets.Dataset.from_dict({"text": TEXTS[20:]}),
    }).save_to_disk(saved)
    with Mdat.create(tmp_path / "c") as mdat:
        with pytest.raises(SplitError, match=r"holds the splits train, test; choose one"):
            mdat.add_hf_dataset("d", saved)
        with pytest.raises(SplitError, match=r"no split 'tain'; did you mean 'train'"):
            mdat.add_hf_dataset("d", saved, split="tain")
        with pytest.raises(BadRecord, match=rf"{saved} split train row 10: the text column"):
            mdat.add_hf_dataset("d", saved, split="train", batch_size=4)
        assert mdat.submdats()[0].source == f"{saved} split train"
        with pytest.raises(ResumeMismatch, match=r"split train"):
            mdat.add_hf_dataset("d", saved, split="test", skip_bad=True)
        info = mdat.add_hf_dataset("d", saved, split="train", skip_bad=True)
        assert (info.documents, info.skipped_invalid) == (20, 1)
        assert contents(mdat, "d")[0] == TEXTS[:20]
        with pytest.raises(MissingTextColumn, match=r"split test has no column 'body' "
                                                    r"\(columns: text\)"):
            mdat.add_hf_dataset("e", saved, split="test", text_field="body")
        with pytest.raises(UnreadableSource, match=r"not a folder written by save_to_disk"):
            mdat.add_hf_dataset("e", tmp_path / "c" / "datasets")
        with pytest.raises(SourceNotFound, match=r"is no folder, and '.*nowhere' no hub"):
            mdat.add_hf_dataset("e", tmp_path / "nowhere")
        datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(tmp_path / "one")
        with pytest.raises(SplitError, match=r"one holds one dataset, not a DatasetDict"):
            mdat.add_hf_dataset("e", tmp_path / "one", split="train")


def hub_cache(cache: Path, repo: str, files: dict[str, list[str] | str]) -> Path:
    """A hub cache holding dataset ``repo`` at commit SHA, as huggingface_hub leaves one:
    ``refs/main`` names the commit, the snapshot's files link to blobs. ``files``: a list of
    texts becomes a Parquet file, a string is written as it is."""
    root = cache / f"datasets--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(SHA)
    (root / "blobs").mkdir()
    for number, (name, content) in enumerate(files.items()):
        blob = root / "blobs" / f"{number:040x}"  # real blobs are named by their hash
        if isinstance(content, str):
            blob.write_text(content)
        else:
            write_parquet(blob, content)
        link = root / "snapshots" / SHA / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return cache


CONFIGS = """---
configs:
- config_name: en
  data_files:
  - split: train
    path: en/*.parquet
- config_name: fr
  data_files:
  - split: train
    path: fr/*.parquet
---
"""


def test_hub_dataset_id_is_read_offline_from_the_hub_cache(tmp_path, monkeypatch) -> None:
    datasets = needs_datasets()
    cache = hub_cache(tmp_path / "hub", "org/tiny", {
        "data/train-00000-of-00002.parquet": TEXTS[:25],
        "data/train-00001-of-00002.parquet": TEXTS[25:],
        "data/test-00000-of-00001.parquet": ["held out"],
    })
    hub_cache(cache, "org/multi", {"README.md": CONFIGS, "en/0.parquet": ["english"],
                                   "fr/0.parquet": ["français"]})
    hub_cache(cache, "org/lines", {"train.jsonl": '{"text": "a line"}\n'})
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(cache))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    jsonl = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in TEXTS])

    expected = imported(tmp_path / "jsonl", lambda m: m.add_jsonl("d", jsonl, batch_size=7))
    hub = imported(tmp_path / "hub-import",
                   lambda m: m.add_hf_dataset("d", "org/tiny", split="train", batch_size=7))
    assert hub == expected
    with Mdat.create(tmp_path / "c") as mdat:
        with pytest.raises(SplitError, match=r"org/tiny@main config default holds the splits"):
            mdat.add_hf_dataset("d", "org/tiny")
        info = mdat.add_hf_dataset("d", "org/tiny", split="test", revision=SHA)
        assert info.source == f"hub dataset org/tiny@{SHA} config default split test"
        with pytest.raises(SplitError, match=r"Config name is missing.*en.*fr.*--hf-config"):
            mdat.add_hf_dataset("m", "org/multi", split="train")
        mdat.add_hf_dataset("m", "org/multi", split="train", config="fr")
        assert contents(mdat, "m")[0] == ["français"]
        with pytest.raises(UnreadableSource, match=r"org/lines@main config default holds "
                                                   r"json files, not Parquet.*--jsonl"):
            mdat.add_hf_dataset("x", "org/lines", split="train")
        with pytest.raises(SourceNotFound, match=r"hub dataset org/absent@main is not in "
                                                 r"the cache.*hf download org/absent"):
            mdat.add_hf_dataset("x", "org/absent", split="train")


def run(capsys, *argv) -> tuple[str, str]:
    main([str(a) for a in argv])
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_cli_adds_parquet_and_saved_datasets(tmp_path, capsys) -> None:
    datasets = needs_datasets()
    c = tmp_path / "c"
    first = write_parquet(tmp_path / "a.parquet", [None, *TEXTS[:9]], body=TEXTS[:10])
    second = write_parquet(tmp_path / "b.parquet", TEXTS[10:20])
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": TEXTS})}).save_to_disk(
        tmp_path / "saved")
    run(capsys, "create", c)
    out, err = run(capsys, "add", c, "p", "--parquet", first, second, "--skip-bad",
                   "--compress")
    assert "p: 19 documents" in out and "1 invalid" in out and "import p" in err
    out, _ = run(capsys, "add", c, "h", "--hf-dataset", tmp_path / "saved", "--split", "train",
                 "--text-field", "body")
    assert "h: 45 documents" in out
    with Mdat.open(c) as mdat:
        assert [info.compression for info in mdat.submdats()] == ["zstd", "none"]
        assert mdat.submdat("p").text(0) == TEXTS[0]
    for argv, message in [
        (["--hf-dataset", tmp_path / "saved"], "holds the splits train; choose one"),
        (["--parquet", first, "--text-field", "tx"], "has no column 'tx' (columns: text, body)"),
        (["--parquet", first, "--split", "train"], "--split goes with --hf-dataset only"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(["add", str(c), "x", *map(str, argv)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_cli_reads_a_hub_id_with_hf_hub_cache_and_hf_hub_offline(tmp_path) -> None:
    needs_datasets()
    cache = hub_cache(tmp_path / "hub", "org/tiny",
                      {"data/train-00000-of-00001.parquet": TEXTS})
    Mdat.create(tmp_path / "c").close()
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "datasets-cache"), "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "matformer.scripts.mdat_cli", "add", str(tmp_path / "c"), "d",
         "--hf-dataset", "org/tiny", "--split", "train"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "d: 45 documents" in done.stdout
    with Mdat.open(tmp_path / "c") as mdat:
        assert contents(mdat, "d")[0] == TEXTS
        assert np.array_equal(mdat.submdat("d").sizes,
                              [len(t.encode()) for t in TEXTS])
