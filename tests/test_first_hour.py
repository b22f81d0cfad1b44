"""What a newcomer met in a first hour with the commands (issue 32), one test per friction:
each fails on the code as it was and passes now."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from client.cli import SHARED, parse_args
from client.federated import FederatedOptions


@pytest.mark.parametrize(("flags", "named"), [
    (["--lr", "0.1"], "--lr applies"),
    (["--steps", "5", "--optimizer", "muon", "--out", "x", "--track", "none"],
     "--steps, --optimizer, --out, --track apply"),
    (["--fsdp"], "--fsdp applies"),
    (["--set", "training.lr=0.1"], "--set applies"),
])
def test_a_federated_client_refuses_the_flags_of_standalone_training(flags, named, capsys):
    """They were accepted and ignored: the coordinator's run.toml decides them."""
    with pytest.raises(SystemExit) as exited:
        parse_args(["train", "--server", "127.0.0.1:7070", *flags])
    assert exited.value.code == 2
    said = capsys.readouterr().err
    assert f"{named} to standalone training only" in said
    assert "leave out --server" in said


def test_standalone_training_refuses_the_flags_of_a_federated_run(capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(["train", "--tier", "1", "--name", "laptop", "--max-rounds", "3"])
    assert exited.value.code == 2
    assert ("--tier, --name, --max-rounds apply to a federated run only: add --server HOST:PORT"
            in capsys.readouterr().err)


def test_the_flags_both_kinds_of_training_read_are_taken_by_a_federated_client():
    args = parse_args(["train", "--server", "127.0.0.1:7070", "--device", "cpu",
                       "--precision", "bf16", "--batching", "padded", "--microbatch-tokens",
                       "256", "--microbatch-examples", "8", "--data", "docs.mdat"])
    assert set(SHARED) <= {f.name for f in FederatedOptions.__dataclass_fields__.values()}
    assert (args.precision, args.batching, args.microbatch_tokens) == ("bf16", "padded", 256)


def test_the_client_command_exits_at_once_on_an_ignored_flag():
    done = subprocess.run(
        [sys.executable, "-m", "client.cli", "train", "--server", "127.0.0.1:7070", "--lr",
         "0.1"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        "matformer-client train: error: --lr applies to standalone training only (in a "
        "federated run the coordinator's run.toml decides). Drop it, or leave out --server "
        "to train on this machine alone.")


COMMANDS = {  # each command's main, as pyproject's [project.scripts] names it
    "matformer-train": "client.standalone", "matformer-client": "client.cli",
    "matformer-server": "server.main", "matformer-eval": "scripts.evaluate",
    "matformer-generate": "scripts.generate", "matformer-mdat": "scripts.mdat_cli",
    "matformer-export-tiers": "scripts.export_matformer_tiers",
    "local-testnet": "local_testnet.main",
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_says_its_version(command, capsys):
    import importlib
    from importlib import metadata

    with pytest.raises(SystemExit) as exited:
        importlib.import_module(COMMANDS[command]).main(["--version"])
    assert exited.value.code == 0
    said = capsys.readouterr().out
    assert said.startswith(f"{command} {metadata.version('matformer')} (torch ")


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        parse_args(["train", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--lr LR default: 0.003" in shown  # an option without help text
    assert "(simulates a slow network) (default: 0.0)" in shown  # a zero is shown too
    assert "how many of those checkpoints to keep (default: 2)" in shown  # not twice
    assert "--compile torch.compile the model (needs a C++ compiler on CPU) --fsdp" in shown


def test_ctrl_c_in_training_says_how_to_resume_without_a_traceback(tmp_path):
    import shlex
    import signal
    import time

    from client.standalone import parse_args as train_args
    from modeling.mdat import build_default_mdat

    build_default_mdat(tmp_path / "docs.mdat", limit=120).close()
    out = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "client.standalone", "--data", str(tmp_path / "docs.mdat"),
         "--steps", "2000", "--batch-tokens", "512", "--seq-len", "128", "--save-every", "2",
         "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not (tmp_path / "run.checkpoints" / "step-2").is_dir():
        assert process.poll() is None and time.monotonic() < deadline, "no checkpoint"
        time.sleep(0.05)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err
    assert "Traceback" not in err
    said = err.splitlines()
    assert said[-2] == "matformer-train: stopped (Ctrl-C); resume with:"
    program, *argv = shlex.split(said[-1])
    assert program == "matformer-train"
    again = train_args(argv)
    assert again.out == out and again.steps == 2000
    assert again.resume.parent == tmp_path / "run.checkpoints" and again.resume.is_dir()


def test_a_client_says_at_once_that_the_coordinator_does_not_answer():
    """It retried for 60 s in silence; now the first unanswered call is said, once."""
    import socket

    from client.connection import Connection
    from client.errors import Unreachable

    with socket.socket() as taken:  # a port nothing listens on
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
    lines: list[str] = []
    connection = Connection(f"127.0.0.1:{port}", patience_s=2.0, log=lines.append)
    try:
        with pytest.raises(Unreachable, match="check --server"):
            connection.heartbeat(0)
    finally:
        connection.close()
    assert connection.calls["Heartbeat"] >= 2  # retried, and said once
    assert len(lines) == 1
    assert lines[0].startswith(f"the coordinator at 127.0.0.1:{port} does not answer Heartbeat")
    assert lines[0].endswith("retrying for up to 2 s")


def test_the_models_vocabulary_follows_a_strategys_or_the_mismatch_is_one_line(tmp_path, capsys):
    """A BPE strategy of more ids than the default model's 260 ended in a 60-line IndexError
    from F.embedding. Now a run that names no model takes the strategy's vocabulary, and one
    that names a smaller model is refused in one line naming both sizes."""
    import json

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from client.standalone import TINY
    from client.standalone import main as train_main
    from modeling.mdat import Mdat

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel()
    texts = [f"def read_{i}(path): return open(path).read() + {i * 7}" for i in range(300)]
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=1000,
                                                       special_tokens=["<unk>", "<eos>"]))
    bpe.save(str(tmp_path / "tokenizer.json"))
    ids = bpe.get_vocab_size()
    assert ids > 260
    with Mdat.create(tmp_path / "bpe.mdat") as mdat:
        mdat.add_records("t", ({"text": t} for t in texts))
        mdat.add_strategy({"strategy_name": "bpe", "tokenizer_type": "huggingface",
                           "tokenizer_name": str(tmp_path / "tokenizer.json"),
                           "chunk_size": 16})
        mdat.pretokenize("bpe")
    common = ["--data", str(tmp_path / "bpe.mdat"), "--strategy", "bpe", "--seq-len", "32",
              "--batch-tokens", "256", "--steps", "2", "--tiers", "0"]
    train_main([*common, "--out", str(tmp_path / "taken")])
    assert f"the model's vocabulary is strategy 'bpe''s, {ids:,} ids" in capsys.readouterr().out
    saved = json.loads((tmp_path / "taken" / "config.json").read_text())
    assert saved["vocab_size"] == ids

    (tmp_path / "small.json").write_text(json.dumps(dict(TINY, vocab_size=260)))
    with pytest.raises(SystemExit) as exited:
        train_main([*common, "--config", str(tmp_path / "small.json"), "--out",
                    str(tmp_path / "refused")])
    assert exited.value.code == 2
    said = capsys.readouterr().err.strip()
    assert said == (f"matformer-train: error: strategy 'bpe' gives token ids up to {ids - 1:,} "
                    f"(a vocabulary of {ids:,}), but the model's vocab_size is 260; raise the "
                    "model's vocab_size to at least that, or name no model to take the "
                    "strategy's.")
    assert not (tmp_path / "refused" / "model.safetensors").exists()
