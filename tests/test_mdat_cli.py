"""`matformer-mdat`: every subcommand once, and errors as one line with exit code 2."""

import json

import numpy as np
import pytest

from matformer.modeling.mdat import Mdat, SaettaReader
from matformer.scripts.mdat_cli import main


def run(capsys, *argv: str) -> tuple[str, str]:
    main([str(a) for a in argv])
    captured = capsys.readouterr()
    return captured.out, captured.err


def test_full_workflow(tmp_path, capsys) -> None:
    c = tmp_path / "c"
    lines = [json.dumps({"body": f"Sentence {i}. Another one {i}!", "id": i}) for i in range(40)]
    (tmp_path / "in.jsonl").write_text("\n".join([*lines, "{broken"]) + "\n")
    strategy = {"strategy_name": "b16", "chunk_size": 16, "splitter_class": "sentence_chunks"}
    (tmp_path / "s.json").write_text(json.dumps(strategy))

    out, _ = run(capsys, "create", c, "--extended")
    assert "up to 65535 submdats" in out
    out, err = run(capsys, "add", c, "docs", "--jsonl", tmp_path / "in.jsonl",
                   "--text-field", "body", "--skip-bad", "--compress")
    assert "docs: 40 documents" in out and "1 invalid" in out
    assert "import docs" in err  # the progress bar goes to stderr
    run(capsys, "strategy", c, tmp_path / "s.json")
    out, _ = run(capsys, "pretokenize", c, "b16", "--processes", "1")
    assert "b16:" in out
    out, _ = run(capsys, "view", c, "small", "docs=10", "--seed", "2")
    assert json.loads(out.split(": ", 1)[1].split(" documents")[0]) == {"docs": 10}
    out, _ = run(capsys, "shuffle", c, "--strategy", "b16", "--max-seq-len", "32",
                 "--view", "small")
    with Mdat.open(c) as mdat:
        assert out == (f"shuffled {len(mdat.sequences('b16', 32, 'small'))} sequences "
                       f"(fingerprint {mdat.fingerprint('b16', 32, 'small')})\n")
    run(capsys, "export-saetta", c, tmp_path / "flat", "--strategy", "b16",
        "--max-seq-len", "32", "--view", "small")
    with Mdat.open(c) as mdat:
        reader = mdat.sequences("b16", 32, "small")
        order = np.load(c / "shuffling" / "small.b16.32.seed0.npy")
        saetta = SaettaReader(tmp_path / "flat")
        assert np.array_equal(saetta[0], reader[int(order[0])])
        assert (saetta.manifest["view"], saetta.manifest["seed"]) == ("small", 0)
        assert saetta.manifest["fingerprint"] == mdat.fingerprint("b16", 32, "small")
    run(capsys, "train-tokenizer", c, "docs", tmp_path / "tok.json", "--vocab-size", "300")
    assert (tmp_path / "tok.json").is_file()
    out, _ = run(capsys, "info", c)
    for expected in ("docs: 40 documents", "(zstd), complete", "b16: bytes tokenizer",
                     "complete, 40 documents", "small (seed 2)", "small.b16.32.seed0"):
        assert expected in out


def test_default_command(tmp_path, capsys) -> None:
    out, _ = run(capsys, "default", tmp_path / "d", "--limit", "12")
    assert "12 documents of stdlib docstrings" in out


@pytest.mark.parametrize(("argv", "message"), [
    (["info", "{tmp}/nowhere"], "nowhere: no such file or folder"),
    (["info", "{tmp}/broken"], "broken/mdat.db cannot be read as an MDAT catalogue"),
    (["add", "{tmp}/c", "x", "--jsonl", "{tmp}/missing.jsonl"], "missing.jsonl does not exist"),
    (["add", "{tmp}/c", "x", "--folder", "{tmp}/missing"], "missing does not exist"),
    (["add", "{tmp}/c", "x", "--jsonl", "{tmp}/empty.jsonl"], "empty.jsonl:1: the text is empty"),
    (["strategy", "{tmp}/c", "{tmp}/hf.json"], "bad_tokenizer.json is not a tokenizer.json"),
    (["pretokenize", "{tmp}/c", "no_such_strategy"], "unknown strategy"),
    (["view", "{tmp}/c", "v", "docs=1"], "unknown submdat"),
    (["remove", "{tmp}/c", "view", "v"], "unknown view"),
])
def test_errors_are_one_line_and_exit_2(tmp_path, capsys, argv, message) -> None:
    Mdat.create(tmp_path / "c").close()
    Mdat.create(tmp_path / "broken").close()
    (tmp_path / "broken" / "mdat.db").write_bytes(b"garbage\n" * 1000)
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n')
    (tmp_path / "bad_tokenizer.json").write_text("{not a tokenizer")
    (tmp_path / "hf.json").write_text(json.dumps({
        "strategy_name": "hf", "chunk_size": 8, "tokenizer_type": "huggingface",
        "tokenizer_name": str(tmp_path / "bad_tokenizer.json")}))
    with pytest.raises(SystemExit) as exit_info:
        main([a.format(tmp=tmp_path) for a in argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    error = err[err.index("matformer-mdat: error: "):]  # after any progress bar
    assert error.count("\n") == 1 and error.endswith("\n")
    assert message in error and "Traceback" not in err


def test_remove_command(tmp_path, capsys) -> None:
    c = tmp_path / "c"
    with Mdat.create(c) as mdat:
        mdat.add_records("a", [{"text": "one"}])
        mdat.add_records("b", [{"text": "two"}])
        mdat.create_view("v", {"a": 1})
    out, _ = run(capsys, "remove", c, "view", "v")
    assert out == "removed view v\n"
    run(capsys, "remove", c, "submdat", "a")
    with Mdat.open(c) as mdat:
        assert [info.name for info in mdat.submdats()] == ["b"] and mdat.views() == []
