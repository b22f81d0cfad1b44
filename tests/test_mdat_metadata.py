"""Per-document metadata: the other columns of a Parquet file or a `datasets` dataset, and the
other keys of a JSON array's elements, are stored as each document's metadata and read back
equal, whatever the format; `matformer mdat info` lists their fields."""

import datetime
import json
import logging

import pytest

from matformer.modeling.errors import BadRecord, ImportTooLarge, NotUtf8, UnreadableSource
from matformer.modeling.mdat import Mdat
from matformer.modeling.mdat import json_arrays as json_arrays_module
from matformer.scripts.mdat_cli import main

pa = pytest.importorskip("pyarrow", reason="pyarrow is missing: pip install 'matformer[formats]'")
pq = pytest.importorskip("pyarrow.parquet")

COUNTERS = ("documents", "records_read", "records_sha256", "raw_bytes", "skipped_invalid",
            "skipped_not_utf8")
# One row per document: its text, then the fields metadata keeps (dates come back as ISO text).
ROWS = [{"text": f"Dokument {i}: " + "wörd " * (i % 5 + 1), "id": i,
         "lang": ["en", "it", "de"][i % 3], "score": i / 4, "ok": i % 2 == 0,
         "day": datetime.date(2024, 1, 1 + i), "note": None if i % 4 else "vier"}
        for i in range(12)]
EXPECTED = [{key: value.isoformat() if isinstance(value, datetime.date) else value
             for key, value in row.items() if key != "text"} for row in ROWS]


def table(**extra) -> pa.Table:
    """ROWS as a table ("lang" dictionary-encoded, as a repeated label usually is)."""
    columns = {key: [row[key] for row in ROWS] for key in ROWS[0]}
    columns["lang"] = pa.array(columns["lang"]).dictionary_encode()
    columns["note"] = pa.array(columns["note"], pa.string())
    return pa.table({**columns, **extra})


def imported(mdat: Mdat, name: str) -> tuple[dict, list[str], list[dict]]:
    info = {key: getattr(mdat.submdat(name).info, key) for key in COUNTERS}
    submdat = mdat.submdat(name)
    return (info, [submdat.text(i) for i in range(len(submdat))],
            [submdat.metadata(i) for i in range(len(submdat))])


def test_every_format_keeps_the_same_metadata(tmp_path, caplog) -> None:
    datasets = pytest.importorskip("datasets")
    json_rows = [{"text": row["text"], **fields} for row, fields in zip(ROWS, EXPECTED,
                                                                         strict=True)]
    (tmp_path / "rows.json").write_text(json.dumps(json_rows, ensure_ascii=False, indent=1))
    (tmp_path / "rows.jsonl").write_text("\n".join(json.dumps(r) for r in json_rows) + "\n")
    # Two files, several row groups; lists and bytes are no metadata: left out, and said so.
    left_out = {"tags": [[i, i] for i in range(12)], "blob": [b"\x00"] * 12}
    whole = table(**left_out)
    pq.write_table(whole.slice(0, 7), tmp_path / "a.parquet", row_group_size=3)
    pq.write_table(whole.slice(7), tmp_path / "b.parquet", row_group_size=2)
    datasets.Dataset(whole).save_to_disk(tmp_path / "saved")

    with Mdat.create(tmp_path / "c") as mdat, caplog.at_level(logging.WARNING):
        mdat.add_jsonl("jsonl", tmp_path / "rows.jsonl")
        mdat.add_json("json", tmp_path / "rows.json", batch_size=5)
        mdat.add_parquet("parquet", [tmp_path / "a.parquet", tmp_path / "b.parquet"],
                         batch_size=5)
        mdat.add_hf_dataset("saved", tmp_path / "saved", batch_size=5)
        expected = imported(mdat, "jsonl")
        assert expected[1] == [row["text"] for row in ROWS] and expected[2] == EXPECTED
        for name in ("json", "parquet", "saved"):
            assert imported(mdat, name) == expected, name
    warnings = [r.getMessage() for r in caplog.records if "not kept as metadata" in r.message]
    assert len(warnings) == 2  # one per import, naming each column left out
    assert all("blob (binary), tags (list<" in warning for warning in warnings)


def test_a_metadata_cell_that_is_not_utf8_is_a_bad_row_named_by_its_column(tmp_path) -> None:
    notes = pa.array([b"fine", b"\xff\xfe", b"fine"], pa.binary()).view(pa.string())
    pq.write_table(pa.table({"text": ["one", "two", "three"], "note": notes}),
                   tmp_path / "a.parquet")
    with Mdat.create(tmp_path / "c") as mdat:
        with pytest.raises(NotUtf8, match=rf"{tmp_path / 'a.parquet'} row 1: column 'note' is "
                                          r"not valid UTF-8"):
            mdat.add_parquet("strict", tmp_path / "a.parquet")
        info = mdat.add_parquet("lenient", tmp_path / "a.parquet", skip_bad=True)
        assert (info.documents, info.skipped_not_utf8) == (2, 1)
        assert mdat.submdat("lenient").metadata(1) == {"note": "fine"}


def test_a_json_array_read_in_small_blocks_equals_json_load(tmp_path, monkeypatch) -> None:
    values = [{"text": "a", "n": 123456789}, {"text": "b\u00e9\\\"c", "n": -1.5e-7,
                                               "deep": {"x": [1, {"y": None}]}},
              {"n": 3}, "no object", {"text": "last", "ok": True}]
    (tmp_path / "a.json").write_text(" [ " + " ,\n ".join(json.dumps(v) for v in values) + "]\n",
                                     encoding="utf-8-sig")  # as editors that mark UTF-8 write
    monkeypatch.setattr(json_arrays_module, "_READ", 3)  # numbers and strings cut by blocks
    with Mdat.create(tmp_path / "c") as mdat:
        with pytest.raises(BadRecord, match=r"a\.json element 2: no text field 'text'"):
            mdat.add_json("strict", tmp_path / "a.json")
        info = mdat.add_json("d", tmp_path / "a.json", skip_bad=True)
        submdat = mdat.submdat("d")
        assert (info.documents, info.skipped_invalid) == (3, 2)
        assert [submdat.text(i) for i in range(3)] == ["a", "b\u00e9\\\"c", "last"]
        assert [submdat.metadata(i) for i in range(3)] == [
            {"n": 123456789}, {"n": -1.5e-7, "deep": {"x": [1, {"y": None}]}}, {"ok": True}]


@pytest.mark.parametrize(("content", "error", "message"), [
    ('{"text": "a"}', UnreadableSource, r"holds no JSON array \(it starts with '\{'\); give a "
                                        r"file of the form \[\{\"text\": \.\.\.\}, \.\.\.\], or "
                                        r"JSON Lines with --jsonl"),
    ('[{"text": "a"}, {"text": }]', UnreadableSource, r"element 1 is not valid JSON \(Expecting "
                                                      r"value at character 25\); fix the file"),
    ('[{"text": "a"} {"text": "b"}]', UnreadableSource, r"expected , or \] after element 0 "
                                                        r"\(character 15\), found '\{'"),
    ('[{"text": "a"}', UnreadableSource, r"expected , or \] after element 0 .* found the end "
                                         "of the file"),
    ('[{"text": "a"}] []', UnreadableSource, r"more follows the array's end \(character 16\)"),
    ('[{"text": "' + "x" * (1 << 20) + '"}]', ImportTooLarge,
     r"element 0 is longer than the read limit of 1\.0 MiB of text; .*"
     r"MATFORMER_MDAT_READ_LIMIT_MIB=1024"),
], ids=["not an array", "bad element", "no comma", "not closed", "more after", "too large"])
def test_a_broken_json_array_is_refused_naming_where(tmp_path, monkeypatch, content, error,
                                                     message) -> None:
    monkeypatch.setenv("MATFORMER_MDAT_READ_LIMIT_MIB", "1")
    (tmp_path / "a.json").write_text(content)
    with Mdat.create(tmp_path / "c") as mdat, pytest.raises(error, match=message):
        mdat.add_json("d", tmp_path / "a.json", skip_bad=True)


def test_cli_adds_a_json_array_and_info_lists_metadata_fields(tmp_path, capsys) -> None:
    (tmp_path / "a.json").write_text(json.dumps([{"body": "one", "url": "u1"},
                                                 {"body": "two", "url": "u2", "lang": "en"}]))
    pq.write_table(table(), tmp_path / "a.parquet")
    main(["create", str(tmp_path / "c")])
    main(["add", str(tmp_path / "c"), "arr", "--json", str(tmp_path / "a.json"),
          "--text-field", "body"])
    main(["add", str(tmp_path / "c"), "tab", "--parquet", str(tmp_path / "a.parquet")])
    main(["info", str(tmp_path / "c")])
    out = capsys.readouterr().out
    assert "arr: 2 documents" in out
    assert "metadata: url, lang (fields of the first 100 documents)" in out
    assert "metadata: id, lang, score, ok, day, note (fields of the first 100" in out
