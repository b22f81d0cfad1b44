"""What a newcomer met in a first hour with the commands (issue 32), one test per friction:
each fails on the code as it was and passes now."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from matformer.client.cli import SHARED, FederatedSettings, parse_args
from matformer.client.federated import FederatedOptions


@pytest.mark.parametrize(("flags", "named"), [
    (["--lr", "0.1"], "--lr applies"),
    (["--steps", "5", "--optimizer", "muon", "--out", "x", "--track", "none"],
     "--steps, --optimizer, --track, --out apply"),
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


@pytest.mark.parametrize(("flags", "message"), [
    (["--compute-speed", "2"], "[client] compute_speed must lie in (0, 1], got 2.0."),
    (["--tier", "-1"], "[client] tier must be >= 0, got -1."),
    (["--rank-timeout-s", "0"], "[client] rank_timeout_s must be > 0"),
])
def test_a_federated_clients_flags_are_checked_by_their_declarations(flags, message, capsys):
    with pytest.raises(SystemExit) as exited:
        parse_args(["train", "--server", "127.0.0.1:7070", *flags])
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_every_federated_setting_is_a_flag_of_the_client_command(capsys):
    with pytest.raises(SystemExit):
        parse_args(["train", "--help"])
    shown = capsys.readouterr().out
    for f in dataclasses.fields(FederatedSettings):
        assert f"--{f.name.replace('_', '-')} " in shown, f.name


def test_the_client_command_exits_at_once_on_an_ignored_flag():
    done = subprocess.run(
        [sys.executable, "-m", "matformer.client.cli", "train", "--server", "127.0.0.1:7070",
         "--lr", "0.1"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        "matformer-client train: error: --lr applies to standalone training only (in a "
        "federated run the coordinator's run.toml decides). Drop it, or leave out --server "
        "to train on this machine alone.")


PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# each command's module, as pyproject's [project.scripts] names it: none can be left out
COMMANDS = {name: target.partition(":")[0] for name, target in
            tomllib.loads(PYPROJECT.read_text())["project"]["scripts"].items()}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_says_its_version(command, capsys):
    import importlib
    from importlib import metadata

    with pytest.raises(SystemExit) as exited:
        importlib.import_module(COMMANDS[command]).main(["--version"])
    assert exited.value.code == 0
    said = capsys.readouterr().out
    assert said.startswith(f"{command} {metadata.version('matformer')} (torch ")


def test_one_command_runs_every_verb_under_its_own_name(tmp_path, capsys):
    from matformer.scripts.verbs import VERBS, main, runner

    assert all(callable(runner(verb)) for verb in VERBS)
    with pytest.raises(SystemExit) as exited:
        main(["eval", "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage: matformer eval")
    assert main(["trian"]) == 2
    assert "no verb 'trian'; did you mean 'train'?" in capsys.readouterr().err
    done = subprocess.run(["matformer", "keys", "list", "--config", str(tmp_path / "no.toml")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("matformer keys: error:")


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        parse_args(["train", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--lr LR peak learning rate (default: 0.003)" in shown  # from train.toml's key
    assert "(simulates a slow network) (default: 0.0)" in shown  # a zero is shown too
    assert "how many of those checkpoints to keep (default: 2)" in shown  # not twice
    assert ("--compile, --no-compile torch.compile the model (needs a C++ compiler on CPU) "
            "(default: False) --fsdp") in shown


def test_ctrl_c_in_training_says_how_to_resume_without_a_traceback(tmp_path):
    import shlex
    import signal
    import time

    from matformer.client.standalone import parse_args as train_args
    from matformer.modeling.mdat import build_default_mdat

    build_default_mdat(tmp_path / "docs.mdat", limit=120).close()
    out = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, "-m", "matformer.client.standalone", "--data", str(tmp_path / "docs.mdat"),
         "--steps", "2000", "--batch-tokens", "512", "--seq-len", "128", "--save-every", "2",
         "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    while not (tmp_path / "run" / "checkpoints" / "step-2").is_dir():
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
    assert again.resume.parent == tmp_path / "run" / "checkpoints" and again.resume.is_dir()


def test_a_client_says_at_once_that_the_coordinator_does_not_answer():
    """It retried for 60 s in silence; now the first unanswered call is said, once."""
    import socket

    from matformer.client.connection import Connection
    from matformer.client.errors import Unreachable

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


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A container pretokenized by a BPE tokenizer of more ids than the default model's 260,
    as a user builds one for their own data: (its folder, the tokenizer, its vocabulary)."""
    from support.models import bpe_mdat

    root = tmp_path_factory.mktemp("bpe")
    texts = [f"def read_{i}(path): return open(path).read() + {i * 7}" for i in range(300)]
    bpe = bpe_mdat(root, texts, 1000)
    return root, bpe, bpe.get_vocab_size()


def bpe_training(root):
    return ["--data", str(root / "bpe.mdat"), "--strategy", "bpe", "--seq-len", "32",
            "--batch-tokens", "256", "--steps", "2", "--tiers", "0,1"]


def test_the_models_vocabulary_follows_a_strategys_or_the_mismatch_is_one_line(bpe, tmp_path,
                                                                               capsys):
    """A BPE strategy of more ids than the default model's 260 ended in a 60-line IndexError
    from F.embedding. Now a run that names no model takes the strategy's vocabulary, and one
    that names a smaller model is refused in one line naming both sizes."""
    import json

    from matformer.client.standalone import TINY
    from matformer.client.standalone import main as train_main

    root, _, ids = bpe
    assert ids > 260
    common = bpe_training(root)
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


def test_a_model_trained_on_a_users_bpe_opens_with_autotokenizer_and_pipeline(bpe, tmp_path):
    """Checkpoints carried no tokenizer: AutoTokenizer and pipeline("text-generation") failed
    with an opaque transformers error, and matformer-generate died without --data. Now the
    model folder, its checkpoints and its slices hold tokenizer.json and its config."""
    import json

    from transformers import AutoTokenizer, pipeline

    from matformer.client.standalone import main as train_main
    from matformer.scripts.export_matformer_tiers import main as export_main

    root, tokenizer, _ = bpe
    out = tmp_path / "model"
    train_main([*bpe_training(root), "--out", str(out), "--save-every", "2"])
    export_main(["--src", str(out), "--tiers", "1"])
    text = "def read_12(path): return open(path).read()"
    eos = tokenizer.token_to_id("<eos>")
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == eos
    for folder in (out, out / "checkpoints" / "step-2", out / "tier1"):
        loaded = AutoTokenizer.from_pretrained(folder)
        assert loaded(text, add_special_tokens=False)["input_ids"] == tokenizer.encode(text).ids
        assert loaded.eos_token_id == eos

    generator = pipeline("text-generation", model=str(out))
    written = generator(text, max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert written.startswith(text) and len(written) > len(text)

    said = subprocess.run(
        [sys.executable, "-m", "matformer.scripts.generate", str(out), "--prompt", text,
         "--max-new-tokens", "4", "--temperature", "0"],
        capture_output=True, text=True, timeout=120)
    assert said.returncode == 0, said.stderr
    assert said.stdout.startswith(text)


def test_a_run_is_one_folder_and_its_slices_follow_its_weights(tmp_path, monkeypatch):
    """A run spread over OUT/, OUT.checkpoints/, OUT.tensorboard/ and OUT-tierN/, and after a
    second run into the same OUT, --load-strategy auto loaded the first run's stale slice."""
    import shutil

    from transformers import AutoTokenizer

    from matformer.client.standalone import main as train_main
    from matformer.modeling.checkpoint.loader import resolve
    from matformer.modeling.errors import SliceMismatch
    from matformer.modeling.mdat import build_default_mdat
    from matformer.modeling.tokenizers import ByteTokenizer
    from matformer.scripts.export_matformer_tiers import main as export_main

    build_default_mdat(tmp_path / "docs.mdat", limit=80).close()
    common = ["--data", str(tmp_path / "docs.mdat"), "--steps", "2", "--batch-tokens", "512",
              "--seq-len", "128", "--tiers", "0,1", "--save-every", "2"]
    run = tmp_path / "run"
    train_main([*common, "--out", str(run)])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.mdat", "run"]
    assert {"checkpoints", "tensorboard", "tokenizer.json", "matformer_data.json"} <= {
        p.name for p in run.iterdir()}
    text = "héllo, wörld\n\tdef f(): pass"
    assert AutoTokenizer.from_pretrained(run)(text, add_special_tokens=False)["input_ids"] \
        == ByteTokenizer().encode(text)

    export_main(["--src", str(run), "--tiers", "1"])
    assert resolve(run, 1, "auto").used == "sliced"
    stale = shutil.copytree(run / "tier1", tmp_path / "stale")

    train_main([*common, "--out", str(run), "--seed", "1"])  # other weights, same folder
    assert not (run / "tier1").exists() and not (run / "matformer_manifest.json").exists()
    assert (run / "checkpoints" / "step-2").is_dir() and (run / "tensorboard").is_dir()
    shutil.copytree(stale, run / "tier1")  # the old slice, without a manifest
    resolved = resolve(run, 1, "auto")
    assert resolved.used == "universal" and "cut from other weights" in resolved.reason
    with pytest.raises(SliceMismatch, match="cut from other weights"):
        resolve(run, 1, "sliced")

    shutil.rmtree(run)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.mdat", "stale"]


def test_a_checkpoint_resumes_into_its_own_run_or_is_refused(tmp_path, monkeypatch, capsys):
    """--resume OTHER/checkpoints/step-N without --out wrote into runs/standalone, replacing
    another run's model. A checkpoint now knows its run and goes on there."""
    from matformer.client.standalone import main as train_main
    from matformer.modeling.checkpoint.manifest import sha256_of
    from matformer.modeling.mdat import build_default_mdat

    monkeypatch.chdir(tmp_path)
    build_default_mdat(tmp_path / "docs.mdat", limit=80).close()
    common = ["--data", str(tmp_path / "docs.mdat"), "--steps", "4", "--batch-tokens", "512",
              "--seq-len", "128", "--tiers", "0", "--save-every", "2", "--track", "none"]
    train_main([*common, "--out", "first"])
    train_main([*common, "--out", "second"])
    first = sha256_of(tmp_path / "first" / "model.safetensors")
    second = sha256_of(tmp_path / "second" / "model.safetensors")

    with pytest.raises(SystemExit) as exited:
        train_main([*common, "--resume", "first/checkpoints/step-2", "--out", "second"])
    assert exited.value.code == 2
    assert (f"is a checkpoint of the run in {tmp_path / 'first'}, which goes on there"
            in capsys.readouterr().err)
    assert sha256_of(tmp_path / "second" / "model.safetensors") == second

    capsys.readouterr()
    train_main([*common, "--resume", "first/checkpoints/step-2"])
    # the first run's step-4 is not overwritten by the resumed run's: set aside, and said
    aside = tmp_path / "first" / "checkpoints" / "replaced-after-step-2"
    assert (aside / "step-4" / "model.safetensors").is_file()
    assert (tmp_path / "first" / "checkpoints" / "step-4" / "model.safetensors").is_file()
    assert f"step-4 of the run this one replaces moved to {aside}" in capsys.readouterr().out
    assert not (tmp_path / "runs").exists()  # not the default folder
    assert sha256_of(tmp_path / "first" / "model.safetensors") == first  # the same run again
    assert sha256_of(tmp_path / "second" / "model.safetensors") == second


def test_a_damaged_token_file_is_named_when_the_data_is_opened(tmp_path, capsys):
    """A token file with flipped bytes went unnoticed until evaluation crashed in the
    embedding lookup; every id is now checked against the strategy's vocabulary on opening."""
    import numpy as np

    from matformer.client.standalone import main as train_main
    from matformer.modeling.errors import MdatCorrupt
    from matformer.modeling.mdat import DEFAULT_STRATEGY, Mdat, build_default_mdat

    build_default_mdat(tmp_path / "docs.mdat", limit=40).close()
    [tokens] = (tmp_path / "docs.mdat").rglob("tokens.npy")
    damaged = np.load(tokens, mmap_mode="r+")
    damaged[1234] |= 0x4000  # a flipped bit: id 16,4xx in a vocabulary of 260
    damaged.flush()
    del damaged
    with Mdat.open(tmp_path / "docs.mdat") as mdat, pytest.raises(
            MdatCorrupt, match=r"tokens\.npy holds token id 16,\d+ \(first at token 1,234\), "
                               r"outside the strategy's vocabulary 0\.\.259"):
        mdat.sequences(DEFAULT_STRATEGY["strategy_name"], 128)
    with pytest.raises(SystemExit) as exited:
        train_main(["--data", str(tmp_path / "docs.mdat"), "--steps", "1", "--out",
                    str(tmp_path / "run")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("matformer-train: error: ") and "the file is damaged" in err
    assert len(err.strip().splitlines()) == 1


def test_generate_refuses_a_tokenizer_of_another_vocabulary_in_one_line(bpe, tmp_path):
    """A checkpoint without its tokenizer, read through bytes, died with a traceback from
    ByteTokenizer.decode at the first id past 259."""
    from matformer.client.standalone import main as train_main

    root, _, ids = bpe
    out = tmp_path / "model"
    train_main([*bpe_training(root), "--out", str(out)])
    (out / "tokenizer.json").unlink()
    said = subprocess.run([sys.executable, "-m", "matformer.scripts.generate", str(out),
                           "--prompt", "def"], capture_output=True, text=True, timeout=120)
    assert said.returncode == 2 and "Traceback" not in said.stderr
    assert said.stderr.strip() == (
        f"matformer-generate: error: the tokenizer has 260 ids and the model {ids:,}: they were "
        "not trained together; give the model's own with --tokenizer tokenizer.json or --data "
        "MDAT --strategy S.")
