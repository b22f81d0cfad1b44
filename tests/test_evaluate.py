"""`matformer-eval`: the training run's held-out loss from its checkpoint, per tier, in
microbatches that split after out of memory."""

from __future__ import annotations

import json
import math

import pytest
import torch

from matformer.client.standalone import main as train
from matformer.modeling.mdat import build_default_mdat
from matformer.scripts.evaluate import main as evaluate


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A standalone run on 150 docstrings: its data and its checkpoint (with metrics.json)."""
    root = tmp_path_factory.mktemp("eval")
    build_default_mdat(root / "docs.mdat", limit=150).close()
    train(["--data", str(root / "docs.mdat"), "--steps", "12", "--warmup-steps", "2",
           "--batch-tokens", "512", "--seq-len", "128", "--tiers", "0,1,2",
           "--out", str(root / "run")])
    return root


def run_eval(trained, tmp_path, *extra):
    out = tmp_path / "eval.json"
    evaluate([str(trained / "run"), "--data", str(trained / "docs.mdat"), "--seq-len", "128",
              "--tiers", "0,1,2", "--json", str(out), *extra])
    return json.loads(out.read_text())


def test_eval_gives_the_training_runs_held_out_loss_per_tier(trained, tmp_path, capsys):
    figures = run_eval(trained, tmp_path, "--mix-n-match", "0,0,1,2")
    final = json.loads((trained / "run" / "metrics.json").read_text())["final"]
    for tier in ("0", "1", "2"):
        assert figures["tiers"][tier]["loss"] == pytest.approx(final[tier], rel=1e-6)
        assert figures["tiers"][tier]["perplexity"] == pytest.approx(
            torch.tensor(final[tier]).exp().item(), rel=1e-5)
    mix = figures["tiers"]["mix:0,0,1,2"]["loss"]  # the 4 layers at tiers 0, 0, 1 and 2
    assert math.isfinite(mix) and all(mix != figures["tiers"][t]["loss"] for t in "012")
    assert figures["split"] == "held-out" and figures["sequences"] > 0
    assert "tier mix:0,0,1,2" in capsys.readouterr().out


def test_an_evaluation_over_budget_is_microbatched_and_split_after_oom(trained, tmp_path,
                                                                      monkeypatch):
    whole = run_eval(trained, tmp_path)
    small = run_eval(trained, tmp_path, "--max-eval-tokens-per-microbatch", "128",
                     "--max-examples-per-microbatch", "1")
    from matformer.modeling.models import TransformerWithLMHead

    loss, calls = TransformerWithLMHead.labelled_loss, []

    def short_of_memory(model, batch, labels, **kwargs):
        calls.append(batch.data.shape[0])
        if batch.data.shape[0] > 2:  # more than two rows never fit
            raise torch.OutOfMemoryError("out of memory (injected)")
        return loss(model, batch, labels, **kwargs)

    monkeypatch.setattr(TransformerWithLMHead, "labelled_loss", short_of_memory)
    split = run_eval(trained, tmp_path)
    assert max(calls) > 2 and any(rows <= 2 for rows in calls)
    for tier in ("0", "1", "2"):
        for other in (small, split):
            assert other["tiers"][tier]["loss"] == pytest.approx(
                whole["tiers"][tier]["loss"], rel=1e-6)


def test_one_sequence_that_does_not_fit_is_a_named_error(trained, tmp_path, monkeypatch,
                                                         capsys):
    from matformer.modeling.models import TransformerWithLMHead

    def never_fits(model, batch, labels, **kwargs):
        raise torch.OutOfMemoryError("out of memory (injected)")

    monkeypatch.setattr(TransformerWithLMHead, "labelled_loss", never_fits)
    with pytest.raises(SystemExit) as exit_info:
        run_eval(trained, tmp_path)
    assert exit_info.value.code == 2
    assert "does not fit in memory for evaluation" in capsys.readouterr().err


def test_eval_reads_what_the_run_trained_on_from_its_folder(trained, tmp_path, capsys):
    """It looked for runs/python_docs.mdat, a default the user never named: a folder
    matformer-train wrote now says its container, strategy, view, seq_len and seed."""
    out = tmp_path / "eval.json"
    evaluate([str(trained / "run"), "--tiers", "0,1,2", "--json", str(out)])
    figures = json.loads(out.read_text())
    final = json.loads((trained / "run" / "metrics.json").read_text())["final"]
    assert figures["data"] == str((trained / "docs.mdat").resolve())
    assert figures["seq_len"] == 128
    for tier in ("0", "1", "2"):
        assert figures["tiers"][tier]["loss"] == pytest.approx(final[tier], rel=1e-6)


def test_a_checkpoint_that_names_no_data_asks_for_it_in_one_line(trained, tmp_path, capsys):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(trained / "run", bare, ignore=shutil.ignore_patterns("matformer_data.json"))
    with pytest.raises(SystemExit) as exit_info:
        evaluate([str(bare)])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"matformer-eval: error: {bare} does not say what it was trained on (no "
        "matformer_data.json); name the container with --data MDAT.")
