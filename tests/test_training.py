"""Multi-tier training steps and the standalone training command."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from support.models import TAILS_STRATEGY, mdat_with_one_token_tails, tiny_config

from matformer.client.standalone import main
from matformer.modeling import AutoregressiveModel, BatchError, ConfigError, TierError
from matformer.modeling.batching import AdaptiveLimitsConfig, MicrobatchRunner
from matformer.modeling.checkpoint import load_pretrained
from matformer.modeling.matformer import tier_label
from matformer.modeling.mdat import build_default_mdat
from matformer.modeling.training import TierSchedule, train_step_on_examples, with_targets


def _whole_batch_step(model, optimizer, inputs, schedule, step):
    """The reference: forward/backward of the whole batch at the step's tiers, one step."""
    optimizer.zero_grad()
    losses = {}
    for tier, weight in schedule.step_tiers(step):
        loss = model.loss(inputs, tier=tier)
        (weight * loss).backward()
        losses[tier_label(tier)] = loss.item()
    optimizer.step()
    return losses


def test_all_tiers_step_equals_the_weighted_sum_of_losses():
    torch.manual_seed(0)
    model = AutoregressiveModel(tiny_config())
    twin = AutoregressiveModel(tiny_config())
    twin.load_state_dict(model.state_dict())
    ids = torch.randint(0, 90, (2, 12))
    schedule = TierSchedule(tiers=[0, 2, [0, 1]], weights=[1.0, 0.5, 0.25])
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    runner = MicrobatchRunner(model, AdaptiveLimitsConfig(max_tokens=24).build())
    losses = train_step_on_examples(runner, sgd, list(ids), schedule, step=0)
    assert set(losses) == {"0", "2", "mix:0,1"}

    total = (twin.loss(ids, tier=0) + 0.5 * twin.loss(ids, tier=2)
             + 0.25 * twin.loss(ids, tier=[0, 1]))
    total.backward()
    with torch.no_grad():
        for param in twin.parameters():
            param -= 0.1 * param.grad
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_sampled_tiers_follow_probabilities_and_seed():
    schedule = TierSchedule(tiers=[0, 1, 2], mode="sample", probabilities=[0.6, 0.3, 0.1], seed=3)
    draws = [schedule.step_tiers(step)[0][0] for step in range(3000)]
    assert draws == [schedule.step_tiers(step)[0][0] for step in range(3000)]
    shares = [draws.count(t) / len(draws) for t in (0, 1, 2)]
    assert shares == pytest.approx([0.6, 0.3, 0.1], abs=0.03)
    other = TierSchedule(tiers=[0, 1, 2], mode="sample", probabilities=[0.6, 0.3, 0.1], seed=4)
    assert draws != [other.step_tiers(step)[0][0] for step in range(3000)]


def test_drawn_mixes_are_trained_beside_the_tiers_and_never_widen_with_depth():
    """``mixes``: each step also trains that many per-layer lists of the integer tiers, sorted
    (a deeper layer never wider), not uniform, the same for a step whatever the call; the
    step's gradient is the sum over the tiers and the drawn mixes."""
    schedule = TierSchedule(tiers=[0, 1, 2], mixes=2, seed=5)
    steps = [schedule.step_tiers(step, 4) for step in range(400)]
    assert steps == [schedule.step_tiers(step, 4) for step in range(400)]
    drawn = [tier for step in steps for tier, _ in step[3:]]
    assert all(len(step) == 5 and [t for t, _ in step[:3]] == [0, 1, 2] for step in steps)
    assert all(mix == sorted(mix) and len(set(mix)) > 1 and set(mix) <= {0, 1, 2}
               for mix in drawn)
    assert len({tuple(mix) for mix in drawn}) == 15 - 3  # every mix of 4 layers, 3 tiers
    sampled = TierSchedule(tiers=[0, 1], mode="sample", mixes=1)
    assert all(len(sampled.step_tiers(step, 2)) == 2 for step in range(20))

    torch.manual_seed(0)
    model = AutoregressiveModel(tiny_config())
    twin = AutoregressiveModel(tiny_config())
    twin.load_state_dict(model.state_dict())
    ids = torch.randint(0, 90, (2, 12))
    mixed = TierSchedule(tiers=[0, 2], mixes=1, seed=1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    runner = MicrobatchRunner(model, AdaptiveLimitsConfig(max_tokens=24).build())
    train_step_on_examples(runner, sgd, list(ids), mixed, step=0)
    (mix, _), = mixed.step_tiers(0, 2)[2:]
    assert mix == [0, 2]  # two layers, tiers 0 and 2: the one mix that is not uniform
    (twin.loss(ids, tier=0) + twin.loss(ids, tier=2) + twin.loss(ids, tier=mix)).backward()
    with torch.no_grad():
        for param in twin.parameters():
            param -= 0.1 * param.grad
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(mode="every"), "mode 'every'"),
        (dict(tiers=[0, [0, 1]], mixes=1), "two integer tiers or more"),
        (dict(tiers=[0, 1], mixes=-1), "mixes must be >= 0"),
        (dict(tiers=[0, 1], weights=[1.0]), "1 entries for 2 tiers"),
        (dict(tiers=[0, 1], mode="sample", probabilities=[0.0, 0.0]), "not all zero"),
        (dict(tiers=[]), "at least one tier"),
    ],
)
def test_bad_schedules_are_named_errors(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        TierSchedule(**kwargs)


def test_schedule_checks_tiers_against_the_model():
    with pytest.raises(TierError):
        TierSchedule(tiers=[0, 9]).check(tiny_config())


def test_standalone_training_learns_and_writes_a_loadable_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    build_default_mdat(tmp_path / "docs.mdat", limit=300).close()
    main(["--data", str(tmp_path / "docs.mdat"), "--steps", "30", "--warmup-steps", "3",
          "--batch-tokens", "512", "--seq-len", "128", "--log-every", "10", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "held-out loss tier 2" in printed
    metrics = json.loads((out / "metrics.json").read_text())
    for tier in ("0", "1", "2"):
        assert metrics["final"][tier] < metrics["initial"][tier] - 1.0
    assert len(metrics["history"]) == 30

    model = load_pretrained(out)
    assert torch.isfinite(model.loss(torch.randint(0, 256, (1, 16)), tier=2))
    trained = json.loads((out / "config.json").read_text())
    assert trained["model_type"] == "llama" and trained["intermediate_size"] == 512


def test_with_targets_keeps_the_sequences_a_model_can_learn_from_in_order():
    ids, lengths = np.array([4, 0, 3, 1, 2]), np.array([1, 1, 9, 2, 1])
    assert with_targets(ids, lengths, tiny_config()).tolist() == [3, 2]  # causal: 2 tokens
    assert with_targets(ids, lengths, tiny_config(is_causal=False)).tolist() == [4, 0, 3, 1, 2]
    with pytest.raises(BatchError, match="none of the 2 sequences has the 2 tokens"):
        with_targets(np.array([0, 4]), lengths, tiny_config())


def test_standalone_training_leaves_out_one_token_sequences_and_trains_to_the_end(
        tmp_path, capsys):
    # Sorted by length, the documents' one-token tails would fill a batch without targets.
    data = mdat_with_one_token_tails(tmp_path / "tails.mdat")
    out = tmp_path / "run"
    main(["--data", str(data), "--strategy", TAILS_STRATEGY, "--seq-len", "8",
          "--batch-tokens", "64", "--steps", "12", "--warmup-steps", "2", "--tiers", "0",
          "--out", str(out)])
    printed = capsys.readouterr().out
    assert "left out 40 sequences of fewer than 2 tokens" in printed
    assert len(json.loads((out / "metrics.json").read_text())["history"]) == 12
    assert (out / "model.safetensors").is_file()


def test_token_budget_step_equals_the_whole_batch_step_at_every_tier():
    from matformer.modeling import MaskedBatch
    from matformer.modeling.batching import AdaptiveLimitsConfig, MicrobatchRunner
    from matformer.modeling.training import train_step_on_examples

    torch.manual_seed(0)
    model = AutoregressiveModel(tiny_config())
    twin = AutoregressiveModel(tiny_config())
    twin.load_state_dict(model.state_dict())
    examples = [torch.randint(3, 90, (n,)) for n in (17, 4, 9, 30, 2, 11)]
    schedule = TierSchedule(tiers=[0, 1], weights=[1.0, 0.5])
    runner = MicrobatchRunner(model, AdaptiveLimitsConfig(max_tokens=40, max_examples=2).build())
    losses = train_step_on_examples(runner, torch.optim.SGD(model.parameters(), lr=0.5),
                                    examples, schedule, step=0)
    expected = _whole_batch_step(twin, torch.optim.SGD(twin.parameters(), lr=0.5),
                                 MaskedBatch.from_list(examples), schedule, step=0)
    assert losses.keys() == expected.keys()
    for tier in losses:
        assert losses[tier] == pytest.approx(expected[tier], rel=1e-5)
    for (name, a), b in zip(model.state_dict().items(), twin.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)


def test_client_train_reports_a_bad_data_path_in_one_line(tmp_path, capsys):
    from matformer.client.cli import main as client_main

    with pytest.raises(SystemExit) as exit_info:
        client_main(["train", "--data", str(tmp_path / "missing.mdat"), "--steps", "30"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("matformer-client: error:") and "missing.mdat" in error
    assert "\n" not in error


def test_resume_after_a_kill_equals_the_uninterrupted_run_bit_for_bit(tmp_path):
    """A run killed (SIGKILL) after a checkpoint and resumed from it ends with the weights,
    history and held-out losses of the run that was never stopped."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from safetensors.torch import load_file

    build_default_mdat(tmp_path / "docs.mdat", limit=120).close()
    common = ["--data", str(tmp_path / "docs.mdat"), "--steps", "16", "--warmup-steps", "3",
              "--batch-tokens", "512", "--seq-len", "128", "--tiers", "0,2", "--log-every", "1"]
    main([*common, "--out", str(tmp_path / "straight")])

    out = tmp_path / "killed"
    process = subprocess.Popen(
        [sys.executable, "-m", "matformer.client.standalone", *common, "--out", str(out),
         "--save-every", "4", "--keep-last", "2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 120
    checkpoints = out / "checkpoints"
    while not (checkpoints / "step-8").is_dir() and process.poll() is None:
        assert time.monotonic() < deadline, "no checkpoint within 2 minutes"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    saved = sorted(p.name for p in checkpoints.iterdir())
    assert "step-8" in saved and len(saved) <= 2  # keep_last
    assert not (out / "model.safetensors").exists()  # it never reached the end
    latest = max(checkpoints.iterdir(), key=lambda p: int(p.name[5:]))
    main([*common, "--out", str(out), "--resume", str(latest)])

    straight = load_file(tmp_path / "straight" / "model.safetensors")
    resumed = load_file(out / "model.safetensors")
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    a = json.loads((tmp_path / "straight" / "metrics.json").read_text())
    b = json.loads((out / "metrics.json").read_text())
    assert a["history"] == b["history"] and a["final"] == b["final"]
    assert a["initial"] == b["initial"]


def test_resume_under_other_settings_is_refused_naming_them(tmp_path, capsys):
    build_default_mdat(tmp_path / "docs.mdat", limit=60).close()
    common = ["--data", str(tmp_path / "docs.mdat"), "--steps", "4", "--warmup-steps", "1",
              "--batch-tokens", "512", "--seq-len", "128", "--tiers", "0",
              "--out", str(tmp_path / "run"), "--save-every", "2"]
    main(common)
    with pytest.raises(SystemExit) as exit_info:
        main([*common, "--lr", "0.01", "--resume", str(tmp_path / "run/checkpoints/step-4")])
    assert exit_info.value.code == 2
    assert "--lr '0.003' (now '0.01')" in capsys.readouterr().err


def test_training_writes_tensorboard_events_with_the_expected_tags(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    build_default_mdat(tmp_path / "docs.mdat", limit=60).close()
    main(["--data", str(tmp_path / "docs.mdat"), "--steps", "5", "--warmup-steps", "1",
          "--batch-tokens", "512", "--seq-len", "128", "--tiers", "0,2",
          "--out", str(tmp_path / "run")])
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {"loss/tier_0", "loss/tier_2", "lr", "tokens_per_second", "grad_norm",
                    "held_out/tier_0", "held_out/tier_2"}
    assert [e.step for e in events.Scalars("loss/tier_0")] == [1, 2, 3, 4, 5]
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [e.value for e in events.Scalars("loss/tier_2")] == pytest.approx(
        [h["loss"]["2"] for h in metrics["history"]], rel=1e-6)
    assert [e.step for e in events.Scalars("held_out/tier_0")] == [0, 5]


def _track(kind, tmp_path):
    build_default_mdat(tmp_path / "docs.mdat", limit=30).close()
    main(["--data", str(tmp_path / "docs.mdat"), "--track", kind, "--steps", "3",
          "--warmup-steps", "1", "--seq-len", "128", "--batch-tokens", "512", "--tiers", "0,1",
          "--project", "tracked", "--out", str(tmp_path / "run")])


def test_trackio_records_the_runs_figures_in_its_local_database(tmp_path, monkeypatch):
    import sqlite3

    monkeypatch.setenv("TRACKIO_DIR", str(tmp_path / "trackio"))  # read when imported
    if "trackio" in sys.modules:
        pytest.skip("trackio was imported before: it keeps the folder it read then")
    pytest.importorskip("trackio", reason="trackio is not installed (pip install trackio)")
    _track("trackio", tmp_path)
    with sqlite3.connect(tmp_path / "trackio" / "tracked.db") as db:
        rows = db.execute("SELECT run_name, step, metrics FROM metrics ORDER BY id").fetchall()
    assert {name for name, _, _ in rows} == {"run"}
    logged = [(step, sorted(json.loads(metrics))) for _, step, metrics in rows]
    assert logged[0] == (0, ["held_out/tier_0", "held_out/tier_1"])
    assert [step for step, tags in logged if "loss/tier_1" in tags] == [1, 2, 3]
    assert logged[-1] == (3, ["held_out/tier_0", "held_out/tier_1"])
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    first = metrics["history"][0]["loss"]["0"]
    assert json.loads(rows[1][2])["loss/tier_0"] == pytest.approx(first)


def test_wandb_offline_writes_a_run_with_the_figures(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb)")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    _track("wandb", tmp_path)
    [record] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    written = record.read_bytes()  # protobuf records: the tags and names appear verbatim
    for tag in (b"loss/tier_0", b"loss/tier_1", b"lr", b"grad_norm", b"held_out/tier_1",
                b"tracked"):
        assert tag in written, tag


def test_asking_for_a_tracker_that_is_not_installed_is_a_named_error(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here")
    build_default_mdat(tmp_path / "docs.mdat", limit=30).close()
    with pytest.raises(SystemExit) as exit_info:
        main(["--data", str(tmp_path / "docs.mdat"), "--track", "wandb", "--steps", "2",
              "--warmup-steps", "1", "--seq-len", "128", "--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2
    assert "--track wandb needs the wandb package" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.fixture(scope="module")
def small_docs(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs") / "docs.mdat"
    build_default_mdat(path, limit=40).close()
    return path


def _weights_after(data, out, *extra):
    from safetensors.torch import load_file

    main(["--data", str(data), "--batch-tokens", "512", "--seq-len", "128", "--tiers", "0",
          "--track", "none", "--out", str(out), *extra])
    return load_file(out / "model.safetensors"), json.loads((out / "metrics.json").read_text())


def test_the_schedule_holds_then_decays_to_final_lr(small_docs, tmp_path):
    _, metrics = _weights_after(small_docs, tmp_path / "run", "--steps", "8", "--warmup-steps",
                                "2", "--hold-steps", "3", "--schedule", "linear",
                                "--final-lr", "0.0", "--lr", "0.004")
    lrs = [h["lr"] for h in metrics["history"]]
    assert lrs[:5] == pytest.approx([0.002, 0.004, 0.004, 0.004, 0.004])
    assert lrs[5:] == pytest.approx([0.004, 0.004 * 2 / 3, 0.004 / 3])


def test_a_finished_run_is_lengthened_by_resuming_with_more_steps(small_docs, tmp_path,
                                                                  capsys):
    """--resume with more --steps goes on from the saved state (issue 33: extending a
    finished run): the steps done stay as they were, the schedule spans the new length from
    there (the lr of step 4 is the 8-step schedule's), and fewer steps are refused."""
    schedule = ["--warmup-steps", "1", "--schedule", "linear", "--final-lr", "0.0",
                "--lr", "0.004", "--save-every", "4"]
    _, four = _weights_after(small_docs, tmp_path / "run", "--steps", "4", *schedule)
    step4 = tmp_path / "run" / "checkpoints" / "step-4"
    _, eight = _weights_after(small_docs, tmp_path / "run", "--steps", "8", *schedule,
                              "--resume", str(step4))
    assert "goes on to 8 steps" in capsys.readouterr().out
    assert eight["history"][:4] == four["history"] and len(eight["history"]) == 8
    assert [h["lr"] for h in eight["history"][4:]] == pytest.approx(
        [0.004 * (8 - k) / 7 for k in range(4, 8)])  # linear from step 1 to 0 at step 8
    with pytest.raises(SystemExit):
        _weights_after(small_docs, tmp_path / "run", "--steps", "3", *schedule,
                       "--resume", str(step4))
    assert "past the 3 steps asked now" in capsys.readouterr().err


def test_epochs_reshuffle_per_epoch_reproducibly_and_cover_every_sequence(small_docs, tmp_path):
    from argparse import Namespace

    from matformer.client.epochs import Epochs
    from matformer.modeling.run_order import RunOrder

    ids, lengths = np.arange(100, 160), np.random.default_rng(0).integers(5, 120, 200)
    args = Namespace(seed=1, batching="packed", batch_tokens=256, seq_len=128, steps=None,
                     epochs=3)
    epochs = Epochs(RunOrder(ids, seed=1), lengths, args)
    again = Epochs(RunOrder(ids, seed=1), lengths, args)
    orders = [epochs.epoch(n)[0] for n in range(3)]
    assert np.array_equal(orders[0], ids)  # the shuffle's own order first
    assert not np.array_equal(orders[1], orders[2])
    assert all(np.array_equal(a, again.epoch(n)[0]) for n, a in enumerate(orders))
    other = Epochs(RunOrder(ids, seed=2), lengths, args).epoch(1)[0]
    assert not np.array_equal(other, orders[1])
    per_epoch = [len(epochs.epoch(n)[1]) for n in range(3)]
    assert epochs.steps() == sum(per_epoch)
    seen = [epochs.step(s)[0] for s in range(per_epoch[0], per_epoch[0] + per_epoch[1])]
    assert sorted(np.concatenate(seen).tolist()) == list(range(100, 160))  # once each



def test_epochs_set_the_runs_length_and_exclude_steps(small_docs, tmp_path, capsys):
    import re

    _, metrics = _weights_after(small_docs, tmp_path / "run", "--epochs", "2",
                                "--warmup-steps", "1", "--batch-tokens", "4096")  # few steps
    per_epoch, total = map(int, re.search(r"(\d+) packed batches of <= 4096 tokens an epoch, "
                                          r"(\d+) steps", capsys.readouterr().out).groups())
    assert len(metrics["history"]) == total and per_epoch < total < 3 * per_epoch
    with pytest.raises(SystemExit):
        main(["--data", str(small_docs), "--steps", "3", "--epochs", "1", "--out",
              str(tmp_path / "both")])
    assert "give --steps or --epochs, not both" in capsys.readouterr().err


def test_init_finetunes_a_hugging_face_llama_from_its_own_loss(tmp_path):
    """matformer-train --init starts from a checkpoint's weights and architecture: a Llama
    that transformers saved trains, and its first step's loss is the one transformers gives
    the same sequences (issue 33: finetuning)."""
    import numpy as np
    import transformers

    from matformer.client.epochs import Epochs
    from matformer.client.standalone import parse_args
    from matformer.client.train_config import apply
    from matformer.modeling.mdat import Mdat
    from matformer.modeling.run_order import RunOrder

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=260, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=256,
        tie_word_embeddings=False, pad_token_id=256, bos_token_id=257,
        eos_token_id=258)).eval()  # the byte tokenizer's ids, as the data's
    hf.save_pretrained(tmp_path / "hf")
    build_default_mdat(tmp_path / "docs.mdat", limit=80).close()
    argv = ["--init", str(tmp_path / "hf"), "--data", str(tmp_path / "docs.mdat"),
            "--steps", "2", "--batch-tokens", "512", "--seq-len", "128", "--tiers", "0",
            "--batching", "padded", "--track", "none", "--out", str(tmp_path / "run")]
    main(argv)
    first = json.loads((tmp_path / "run" / "metrics.json").read_text())["history"][0]

    args = apply(parse_args(argv))  # the sequences of step 0, as the run chose them
    with Mdat.open(tmp_path / "docs.mdat") as mdat:
        config = json.loads((tmp_path / "run" / "config.json").read_text())
        assert config["intermediate_size"] == 128 and config["vocab_size"] == 260
        from matformer.modeling.checkpoint import read_config

        reader, order = RunOrder.open(mdat, args.strategy, args.seq_len, None, args.seed,
                                      read_config(tmp_path / "run"))
        ids, _ = Epochs(order, reader.lengths(), args).step(0)
        sequences = [torch.from_numpy(reader[int(i)].astype(np.int64)) for i in ids]
    total, count = 0.0, 0
    with torch.no_grad():
        for tokens in sequences:
            logits = hf(tokens[None]).logits[0, :-1]
            total += torch.nn.functional.cross_entropy(logits, tokens[1:], reduction="sum").item()
            count += len(tokens) - 1
    assert first["loss"]["0"] == pytest.approx(total / count, rel=1e-5)


def test_init_takes_its_checkpoints_architecture_or_refuses_another(tmp_path, capsys):
    build_default_mdat(tmp_path / "docs.mdat", limit=60).close()
    common = ["--data", str(tmp_path / "docs.mdat"), "--steps", "1", "--batch-tokens", "512",
              "--seq-len", "128", "--tiers", "0", "--track", "none"]
    main([*common, "--out", str(tmp_path / "base")])
    (tmp_path / "model.json").write_text((tmp_path / "base" / "config.json").read_text())
    with pytest.raises(SystemExit) as exited:
        main([*common, "--init", str(tmp_path / "base"), "--config",
              str(tmp_path / "model.json"), "--out", str(tmp_path / "refused")])
    assert exited.value.code == 2
    assert "--init takes the architecture of its checkpoint" in capsys.readouterr().err
