"""Imports trust nothing a file declares: a Parquet bomb is refused in bounded memory, a hub
card cannot send the import outside its snapshot, and a malformed save_to_disk folder gives
one line naming the file, never a traceback; no dataset code runs."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_mdat_formats import SHA, TEXTS, hub_cache, needs_datasets, write_parquet

from matformer.modeling.errors import ImportTooLarge, SourceOutsideDataset, UnreadableSource
from matformer.modeling.mdat import Mdat
from matformer.modeling.mdat.tables import READ_LIMIT_ENV
from matformer.scripts.mdat_cli import main

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

REPO = Path(__file__).resolve().parents[1]
MIB = 1 << 20
# Runs the CLI under a data limit 2 GiB above what the interpreter holds (so that a bomb
# cannot take the machine), and prints its exit code and how far its peak RSS grew.
MEASURED_CLI = """
import json, resource, sys
from matformer.scripts.mdat_cli import main
held = next(int(line.split()[1]) for line in open("/proc/self/status")
            if line.startswith("VmData:")) << 10
resource.setrlimit(resource.RLIMIT_DATA, (held + (2 << 30), resource.RLIM_INFINITY))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    main(sys.argv[1:])
    code = 0
except SystemExit as exit:
    code = exit.code
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(json.dumps({"code": code, "grown_mib": grown / 1024}))
"""


def dictionary_bomb(path: Path, value_bytes: int, rows: int) -> Path:
    """``rows`` rows all holding one value of ``value_bytes`` bytes, written as an attacker
    would: the value once in a zstd-compressed dictionary page, the rows as run-length
    encoded indices, and no Arrow schema, so that the column reads back as plain strings."""
    column = pa.DictionaryArray.from_arrays(pa.array(np.zeros(rows, np.int32)),
                                            pa.array(["x" * value_bytes]))
    pq.write_table(pa.table({"text": column}), path, compression="zstd", compression_level=19,
                   write_statistics=False, store_schema=False, row_group_size=rows)
    return path


def understate_footer(path: Path) -> None:
    """Rewrite the footer's ``total_uncompressed_size`` of the one column chunk as 100 bytes
    (a Thrift varint of the same length), as a file that lies about its pages would."""
    def varint(value: int) -> bytearray:
        out = bytearray()
        while value >= 0x80:
            out.append(value & 0x7F | 0x80)
            value >>= 7
        return out + bytes([value])

    declared = pq.ParquetFile(path).metadata.row_group(0).column(0).total_uncompressed_size
    data = bytearray(path.read_bytes())
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    old = varint(declared * 2)  # zigzag
    new = varint(200)
    while len(new) < len(old):  # a redundant continuation keeps the footer's length
        new[-1] |= 0x80
        new.append(0)
    at = data.index(old, footer)
    data[at:at + len(old)] = new
    path.write_bytes(data)
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).total_uncompressed_size == 100


def spy_reads(monkeypatch) -> list[dict]:
    """What each ``ParquetFile.iter_batches`` call asks for, from now on."""
    asked, iter_batches = [], pq.ParquetFile.iter_batches

    def batches(self, *args, **kwargs):
        asked.append(kwargs)
        return iter_batches(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", batches)
    return asked


def test_parquet_bomb_is_refused_by_the_cli_in_bounded_memory(tmp_path) -> None:
    bomb = dictionary_bomb(tmp_path / "bomb.parquet", MIB, 8192)
    assert bomb.stat().st_size < 1024  # under a KiB on disk, 8 GiB of text decoded
    assert pq.ParquetFile(bomb).metadata.num_rows * MIB >= 8 << 30
    Mdat.create(tmp_path / "c").close()
    done = subprocess.run(
        [sys.executable, "-c", MEASURED_CLI, "add", str(tmp_path / "c"), "b", "--parquet",
         str(bomb)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    measured = json.loads(done.stdout.splitlines()[-1])
    errors = [line for line in done.stderr.splitlines() if "matformer-mdat: error" in line]
    assert measured["code"] == 2 and len(errors) == 1 and "Traceback" not in done.stderr
    assert f"{bomb} decodes to more text than it declares (1.0 MiB) by row 257, more than " \
           "the read limit of 256.0 MiB" in errors[0] and READ_LIMIT_ENV in errors[0]
    assert measured["grown_mib"] < 600, measured


def test_a_page_past_the_limit_is_refused_before_decoding_and_the_limit_can_be_raised(
        tmp_path, monkeypatch) -> None:
    file = write_parquet(tmp_path / "a.parquet", [b"small", b"y" * (3 * MIB), b"end"])
    asked = spy_reads(monkeypatch)
    monkeypatch.setenv(READ_LIMIT_ENV, "2")
    with Mdat.create(tmp_path / "c") as mdat:
        with pytest.raises(ImportTooLarge, match=rf"{file} row group 0 has a page of 3.0 MiB "
                                                 r"in column 'text', more than the read "
                                                 r"limit of 2.0 MiB"):
            mdat.add_parquet("d", file)
        assert asked == [] and mdat.submdats() == []  # refused before a row was decoded
        monkeypatch.setenv(READ_LIMIT_ENV, "4")
        assert mdat.add_parquet("d", file).documents == 3


def test_a_footer_that_understates_its_pages_changes_nothing(tmp_path, monkeypatch) -> None:
    honest = dictionary_bomb(tmp_path / "honest.parquet", 64 << 10, 4096)  # 256 MiB decoded
    lying = tmp_path / "lying.parquet"
    shutil.copy(honest, lying)
    understate_footer(lying)
    asked = spy_reads(monkeypatch)
    monkeypatch.setenv(READ_LIMIT_ENV, "1")
    with Mdat.create(tmp_path / "c") as mdat:
        for number, file in enumerate([honest, lying]):
            # Batches sized by the page (64 KiB and a length), not by the 100 bytes claimed.
            with pytest.raises(ImportTooLarge, match=rf"{file} decodes to more text than it "
                                                     r"declares \(0.1 MiB\) by row 17,"):
                mdat.add_parquet(f"d{number}", file)
            assert asked.pop()["batch_size"] == (32 << 20) // ((64 << 10) + 4)


def test_saved_dataset_cell_past_the_limit_is_named_by_row(tmp_path, monkeypatch) -> None:
    datasets = needs_datasets()
    texts = ["one", "two", "three", "z" * (2 * MIB)]
    datasets.Dataset.from_dict({"text": texts}).save_to_disk(tmp_path / "saved")
    monkeypatch.setenv(READ_LIMIT_ENV, "1")
    with Mdat.create(tmp_path / "c") as mdat, pytest.raises(
            ImportTooLarge, match=rf"{tmp_path / 'saved'} row 3 holds 2.0 MiB of text"):
        mdat.add_hf_dataset("d", tmp_path / "saved")


def test_compressed_arrow_in_a_saved_folder_is_refused_before_reading(tmp_path) -> None:
    datasets = needs_datasets()
    saved = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(saved)
    table = pa.table({"text": ["a" * (16 * MIB)] * 4})  # 64 MiB in a few KiB
    arrow = saved / "data-00000-of-00001.arrow"
    with pa.ipc.new_stream(str(arrow), table.schema,
                           options=pa.ipc.IpcWriteOptions(compression="zstd")) as writer:
        writer.write_table(table)
    assert arrow.stat().st_size < 64 << 10
    with Mdat.create(tmp_path / "c") as mdat:
        with pytest.raises(UnreadableSource, match=rf"{arrow} message 1 is compressed, which "
                                                   r"save_to_disk never writes"):
            mdat.add_hf_dataset("d", saved)
        assert mdat.submdats() == []


def evil_hub(tmp_path: Path, monkeypatch, repos: dict[str, dict]) -> dict[str, Path]:
    """``repos`` in a hub cache under ``tmp_path``, beside the user's private Parquet files
    (returned by name); the hub's module reads that cache offline."""
    datasets = needs_datasets()
    private = {"private": write_parquet(tmp_path / "private.parquet", ["secret"])}
    (tmp_path / "other").mkdir()
    private["other"] = write_parquet(tmp_path / "other" / "x.parquet", ["other secret"])
    for repo, files in repos.items():
        hub_cache(tmp_path / "hub", repo, files)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    return private


def card(config: str) -> str:
    return f"---\nconfigs:\n- config_name: default\n{config}\n---\n"


def test_hub_card_naming_files_outside_its_snapshot_is_refused_unread(tmp_path,
                                                                      monkeypatch) -> None:
    private = tmp_path / "private.parquet"
    up = "../../../../other/x.parquet"  # from snapshots/<sha>/ to tmp_path/other
    private_files = evil_hub(tmp_path, monkeypatch, {
        "org/abs": {"README.md": card(f"  data_files:\n  - split: train\n    path: {private}"),
                    "data/train-0.parquet": ["ok"]},
        "org/up": {"README.md": card(f"  data_files:\n  - split: train\n    path:\n    - {up}"),
                   "data/train-0.parquet": ["ok"]},
        "org/dir": {"README.md": card("  data_dir: ../../../../other"),
                    "data/train-0.parquet": ["ok"]},
    })
    assert (tmp_path / "hub" / "datasets--org--up" / "snapshots" / SHA / up).resolve() == \
        private_files["other"]
    opened = []
    parquet_file = pq.ParquetFile

    def spy(source, *args, **kwargs):
        opened.append(Path(source).resolve())
        return parquet_file(source, *args, **kwargs)

    monkeypatch.setattr(pq, "ParquetFile", spy)
    with Mdat.create(tmp_path / "c") as mdat:
        for repo, named in [("org/abs", str(private)), ("org/up", up),
                            ("org/dir", "../../../../other")]:
            with pytest.raises(SourceOutsideDataset, match=rf"hub dataset {repo}@main: its card "
                                                           rf"\(README.md\) points config "
                                                           rf"default at {named}, outside"):
                mdat.add_hf_dataset("d", repo, split="train")
        assert mdat.submdats() == []
    assert not set(opened) & set(private_files.values())


def test_hub_snapshot_file_linking_out_of_its_repository_is_refused(tmp_path,
                                                                     monkeypatch) -> None:
    private = evil_hub(tmp_path, monkeypatch, {
        "org/linked": {"data/train-0.parquet": ["ok"]},
        "org/other": {"data/train-0.parquet": ["another repository's"]}})["private"]
    snapshot = tmp_path / "hub" / "datasets--org--linked" / "snapshots" / SHA
    link = snapshot / "data" / "train-1.parquet"
    with Mdat.create(tmp_path / "c") as mdat:
        # The snapshot's own link into ../../blobs of the same repository is read ...
        assert mdat.add_hf_dataset("d", "org/linked", split="train").documents == 1
        # ... a link to the user's file, or to another repository's blob, is not.
        other = tmp_path / "hub" / "datasets--org--other" / "snapshots" / SHA / "data"
        for target in (private, (other / "train-0.parquet").resolve()):
            link.unlink(missing_ok=True)
            link.symlink_to(target)
            with pytest.raises(SourceOutsideDataset, match=rf"data file {link} lies outside "
                                                           rf"the snapshot {snapshot} \(resolved"
                                                           rf": {target}\); nothing was read"):
                mdat.add_hf_dataset("e", "org/linked", split="train")
        assert [info.name for info in mdat.submdats()] == ["d"]


def test_hub_loading_script_is_never_run(tmp_path, monkeypatch) -> None:
    marker = tmp_path / "ran"
    evil_hub(tmp_path, monkeypatch, {"org/script": {
        f"{SHA}.py": f"open({str(marker)!r}, 'w').write('ran')\n",
        "data/train-0.parquet": ["ok"]}})
    with Mdat.create(tmp_path / "c") as mdat, pytest.raises(
            UnreadableSource, match=rf"org/script@main is a loading script \({SHA}.py\), "
                                    r"which Matformer never runs"):
        mdat.add_hf_dataset("d", "org/script", split="train")
    assert not marker.exists()


ARROW = "data-00000-of-00001.arrow"


def _write(name: str, text: str):
    return lambda folder: (folder / name).write_text(text)


def _arrow(change):
    return lambda folder: (folder / ARROW).write_bytes(change((folder / ARROW).read_bytes()))


MALFORMED = {  # how a good saved folder is broken, and what the one line says
    "no_info": (lambda f: (f / "dataset_info.json").unlink(), "dataset_info.json is missing"),
    "bad_info": (_write("dataset_info.json", "{nope"), "dataset_info.json is not valid JSON"),
    "no_state": (lambda f: (f / "state.json").unlink(), "state.json is missing"),
    "bad_state": (_write("state.json", '{"_data_files": ['), "state.json is not valid JSON"),
    "list_state": (_write("state.json", "[1]"), "state.json holds a JSON list, not an object"),
    "no_files": (_write("state.json", '{"_split": null}'), "state.json has no _data_files"),
    "missing_arrow": (lambda f: (f / ARROW).unlink(), f"state.json lists {ARROW}, which"),
    "outside": (_write("state.json", '{"_data_files": [{"filename": "../x.arrow"}]}'),
                "state.json names '../x.arrow', not a file or folder name inside"),
    "truncated": (_arrow(lambda data: data[:len(data) // 2]),
                  f"{ARROW} is not a whole Arrow stream"),
    "garbage": (_arrow(lambda data: b"\x00garbage" * 64), f"{ARROW} is not a whole Arrow stream"),
    "empty": (_arrow(lambda data: b""), f"{ARROW} is empty, not an Arrow stream"),
}


@pytest.mark.parametrize("case", [*MALFORMED, "wrong_column", "numbers", "bad_dict"])
def test_malformed_saved_folder_gives_one_line_naming_the_file(tmp_path, capsys, case) -> None:
    datasets = needs_datasets()
    saved = tmp_path / "saved"
    columns = {"text": [1, 2]} if case == "numbers" else {"text": TEXTS}
    datasets.Dataset.from_dict(columns).save_to_disk(saved)
    argv, expected = ["--hf-dataset", saved], None
    if case == "wrong_column":
        argv, expected = [*argv, "--text-field", "body"], "has no column 'body' (columns: text)"
    elif case == "numbers":
        expected = "column 'text' holds int64, not text"
    elif case == "bad_dict":
        (saved / "dataset_dict.json").write_text('{"splits": ["train"]}')
        argv, expected = [*argv, "--split", "train"], "dataset_dict.json lists split train, but"
    else:
        change, expected = MALFORMED[case]
        change(saved)
    Mdat.create(tmp_path / "c").close()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["add", str(tmp_path / "c"), "d", *map(str, argv)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("matformer-mdat: error: ")]
    assert exited.value.code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert str(saved) in lines[0] and expected in lines[0], lines[0]


def test_parquet_footer_naming_a_column_in_bytes_that_are_not_utf8_is_one_line(
        tmp_path, capsys) -> None:
    file = write_parquet(tmp_path / "a.parquet", TEXTS[:3], abc=[1, 2, 3])
    data = file.read_bytes()
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    file.write_bytes(data[:footer] + data[footer:].replace(b"abc", b"\x86bc"))
    Mdat.create(tmp_path / "c").close()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(["add", str(tmp_path / "c"), "d", "--parquet", str(file)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err
    assert f"{file} cannot be read as Parquet (" in err and "check the file" in err
