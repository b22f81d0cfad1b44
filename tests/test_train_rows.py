"""Seed 004's token-budget keys in matformer-train: the held-out evaluation's own microbatch
budget, a checkpoint saved before a step that never fits in memory stops the run, and the
lines ``--log-longest-every`` and ``--debug`` print."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from support.helpers import train_data

from matformer.client import standalone
from matformer.client.standalone import main, parse_args
from matformer.client.train_config import apply
from matformer.modeling import training
from matformer.modeling.batching import runner
from matformer.modeling.errors import InvalidValue


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return train_data(tmp_path_factory.mktemp("rows"))


def argv(data: Path, out: Path, *extra: str) -> list[str]:
    return ["--data", str(data / "docs.mdat"), "--config", str(data / "model.json"),
            "--seq-len", "128", "--batch-tokens", "512", "--tiers", "0", "--warmup-steps", "1",
            "--track", "none", "--out", str(out), *extra]


def recording(monkeypatch, module, plans: list) -> None:
    """Every plan ``module``'s ``split_microbatches`` makes: (lengths, max_tokens, plan)."""
    split = module.split_microbatches

    def recorded(lengths, *, max_tokens, **options):
        plan = split(lengths, max_tokens=max_tokens, **options)
        plans.append((list(lengths), max_tokens, plan))
        return plan

    monkeypatch.setattr(module, "split_microbatches", recorded)


@pytest.mark.parametrize("budget", [None, 128])
def test_the_evaluation_keeps_to_its_own_microbatch_budget(data, tmp_path, monkeypatch,
                                                          budget):
    plans = []
    recording(monkeypatch, training, plans)  # held_out_loss's
    extra = [] if budget is None else ["--eval-microbatch-tokens", str(budget)]
    main(argv(data, tmp_path, "--steps", "1", "--microbatch-tokens", "256", *extra))
    assert len(plans) == 2  # before and after training
    for lengths, max_tokens, plan in plans:
        assert max_tokens == (budget or 256)  # without it, the training's microbatch_tokens
        padded = [len(rows) * max(lengths[i] for i in rows) for rows in plan]
        assert max(padded) <= max_tokens and sorted(i for rows in plan for i in rows) == \
            list(range(len(lengths)))
    if budget is not None:
        assert len(plans[0][2]) > len(plans[0][0]) * max(plans[0][0]) // 256


def test_an_evaluation_budget_above_trainings_is_refused(tmp_path):
    (tmp_path / "train.toml").write_text("[training]\nmicrobatch_tokens = 512\n"
                                         "eval_microbatch_tokens = 1024\n")
    said = []
    for args in (["--config", str(tmp_path / "train.toml")],
                 ["--microbatch-tokens", "512", "--eval-microbatch-tokens", "1024"]):
        with pytest.raises(InvalidValue) as refused:
            apply(parse_args(args))
        said.append(str(refused.value))
    assert said[0] == said[1] == (
        "[training] eval_microbatch_tokens 1024 is above microbatch_tokens 512: evaluation's "
        "microbatches are never larger than training's; lower it, or leave it out to use "
        "microbatch_tokens.")
    assert apply(parse_args(["--eval-microbatch-tokens", "512"])).eval_microbatch_tokens == 512


def test_a_step_that_never_fits_saves_the_run_before_it_and_names_what_to_lower(
        data, tmp_path, monkeypatch, capsys):
    """From step 3 on every microbatch runs out of memory: the runner's limits shrink to one
    sequence a microbatch and give up; the run saves what --save-every saves after step 2,
    stops with an error naming what to lower, and the checkpoint resumes into the run that
    never ran out of memory, bit for bit."""
    common = ["--steps", "4", "--no-eval"]
    main(argv(data, tmp_path / "straight", *common))
    shown = capsys.readouterr().out  # the defaults print neither of the lines below
    assert "longest sequences" not in shown and "microbatches" not in shown

    step_of_call, rows_tried = [], []
    step, accumulate = standalone.train_step_on_examples, training.accumulate_gradients

    def stepping(*args, **kwargs):
        step_of_call.append(args[4])
        return step(*args, **kwargs)

    def out_of_memory(model, examples, plan, **kwargs):
        if step_of_call[-1] >= 2:
            rows_tried.append(max(len(rows) for rows in plan))
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return accumulate(model, examples, plan, **kwargs)

    out = tmp_path / "oom"
    with monkeypatch.context() as patched:
        patched.setattr(standalone, "train_step_on_examples", stepping)
        patched.setattr(training, "accumulate_gradients", out_of_memory)
        with pytest.raises(SystemExit) as exit_info:
            main(argv(data, out, *common))
    assert exit_info.value.code == 2
    checkpoint = out / "checkpoints" / "step-2"
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == ["step-2"]
    assert rows_tried[-1] == 1 < rows_tried[0]  # shrunk to one sequence, still too much
    error = capsys.readouterr().err
    assert error.startswith(
        "matformer-train: error: step 3/4 does not fit in memory even one sequence a "
        "microbatch; lower --seq-len (now 128), train fewer or smaller tiers (--tiers 0) or "
        "a smaller model, or train in bf16 (--precision), each a new run; the run as it was "
        f"after step 2 is saved in {checkpoint}: go on from there with --resume")

    main(argv(data, out, *common, "--resume", str(checkpoint)))
    straight, resumed = (load_file(run / "model.safetensors") for run in (tmp_path / "straight",
                                                                          out))
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    histories = [json.loads((run / "metrics.json").read_text())["history"]
                 for run in (tmp_path / "straight", out)]
    assert histories[0] == histories[1]


def test_longest_and_debug_lines_name_each_steps_sequences_and_microbatches(
        data, tmp_path, monkeypatch, capsys):
    plans, lengths = [], []  # the runner's plans; each step's sequence lengths
    recording(monkeypatch, runner, plans)
    step = standalone.train_step_on_examples

    def stepping(run, optimizer, examples, *args, **kwargs):
        lengths.append(sorted((len(e) for e in examples), reverse=True))
        plans.clear()
        losses = step(run, optimizer, examples, *args, **kwargs)
        stepping.ran.append(plans[-1])
        return losses

    stepping.ran = []
    monkeypatch.setattr(standalone, "train_step_on_examples", stepping)
    main(argv(data, tmp_path, "--steps", "4", "--no-eval", "--microbatch-tokens", "256",
              "--log-longest-every", "2", "--debug"))
    printed = capsys.readouterr().out
    longest = re.findall(r"step (\d+)/4: longest sequences ([\d, ]+) tokens "
                         r"\(of (\d+) sequences, ([\d,]+) tokens\)", printed)
    assert [(int(n), shown, int(count), int(tokens.replace(",", "")))
            for n, shown, count, tokens in longest] == [
        (n, ", ".join(map(str, lengths[n - 1][:3])), len(lengths[n - 1]), sum(lengths[n - 1]))
        for n in (2, 4)]
    plan_lines = re.findall(r"step (\d+)/4: (\d+) microbatches, \[rows, padded tokens\] each: "
                            r"(.*)", printed)
    assert [int(n) for n, _, _ in plan_lines] == [1, 2, 3, 4]
    for (_, count, shown), (sizes, _, plan) in zip(plan_lines, stepping.ran, strict=True):
        expected = [[len(rows), len(rows) * max(sizes[i] for i in rows)] for rows in plan]
        assert int(count) == len(plan) > 1
        assert json.loads(f"[{shown.replace('] [', '], [')}]") == expected
        assert all(tokens <= 256 for _, tokens in expected)
