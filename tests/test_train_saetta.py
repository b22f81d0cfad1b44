"""Training from a saetta export (``[data] saetta``, ``--saetta``): the same sequences, in the
same order, step by step and epoch after epoch, as training from the view it was exported
from; an export of another view or shuffle, or of data changed since, is refused naming what
differs."""

import numpy as np
import pytest

from matformer.client import standalone, train_config
from matformer.client.epochs import Epochs
from matformer.client.standalone import open_order, parse_args
from matformer.modeling import ModelConfig
from matformer.modeling.corpus import python_docs
from matformer.modeling.errors import SaettaError
from matformer.modeling.mdat import Mdat, export_saetta

STRATEGY = {"strategy_name": "bytes64", "chunk_size": 64}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A container with view "part", and that view's export shuffled with seed 3."""
    root = tmp_path_factory.mktemp("saetta_training")
    with Mdat.create(root / "c") as mdat:
        mdat.add_records("docs", ({"text": t} for t in python_docs(limit=40)))
        mdat.add_strategy(STRATEGY)
        mdat.create_view("part", {"docs": 30}, seed=1)
        mdat.pretokenize_view("bytes64", "part")
        order = mdat.shuffle("part", "bytes64", 128, seed=3)
        export_saetta(mdat.sequences("bytes64", 128, "part"), order, root / "flat", seed=3)
    return root


def argv(data, *extra: str) -> list[str]:
    return ["--data", str(data / "c"), "--strategy", "bytes64", "--view", "part", "--seq-len",
            "128", "--seed", "3", "--batch-tokens", "512", *extra]


def steps(data, *extra: str) -> list[list[list[int]]]:
    """The tokens of every step of the run's three epochs, then of its held-out sequences."""
    args = train_config.apply(parse_args(argv(data, "--epochs", "3", *extra)))
    with Mdat.open(args.data) as mdat:
        reader, order = open_order(mdat, args, ModelConfig())
        lengths = reader.lengths()
        epochs = Epochs(order, lengths, args)
        batches = [ids for ids, _ in map(epochs.step, range(epochs.steps()))]
        held_out = order.evaluated(lengths, sequences=8, tokens=10**6)
        return [[reader[int(i)].tolist() for i in ids] for ids in [*batches, held_out]]


def test_the_export_gives_each_step_the_views_sequences_in_order(data) -> None:
    from_view = steps(data)
    assert len(from_view) > 10
    assert steps(data, "--saetta", str(data / "flat")) == from_view


def test_a_run_from_the_export_trains_on_the_same_sequences(data, monkeypatch) -> None:
    given, read = standalone.sequences, []

    def recorded(reader, ids, device):
        read.append([reader[int(i)].tolist() for i in ids])
        return given(reader, ids, device)

    monkeypatch.setattr(standalone, "sequences", recorded)
    runs = []
    for extra in ([], ["--saetta", str(data / "flat")]):
        read.clear()
        metrics = standalone.train(parse_args(argv(
            data, "--steps", "2", "--no-eval", "--track", "none", "--out",
            str(data / f"run{len(runs)}"), *extra)))
        runs.append((list(read), [step["loss"] for step in metrics["history"]]))
    assert len(runs[0][0]) == 3 and runs[0][0][1]  # the held-out ones (none read), two steps
    assert runs[1] == runs[0]


@pytest.mark.parametrize(("extra", "differs"), [
    (["--seed", "4"], r"seed 3 \(asked: 4\)"),
    (["--seq-len", "64"], r"max_seq_len 128 \(asked: 64\)"),
    (["--view", "default"], r"view 'part' \(asked: 'default'\)"),
], ids=["seed", "seq_len", "view"])
def test_an_export_of_another_view_or_shuffle_is_refused(data, extra, differs) -> None:
    with pytest.raises(SaettaError, match=rf"flat was exported with {differs}; read it with the "
                                          r"strategy, view, max_seq_len and shuffle seed it was "
                                          r"exported with \(training: --strategy, --view, "
                                          r"--seq-len, --seed\)"):
        steps(data, "--saetta", str(data / "flat"), *extra)


def test_an_export_of_data_changed_since_is_refused(tmp_path) -> None:
    with Mdat.create(tmp_path / "c") as mdat:
        mdat.add_records("a", [{"text": f"document {i} " * 9} for i in range(12)])
        mdat.add_strategy(STRATEGY)
        mdat.pretokenize("bytes64")
        order = mdat.shuffle(None, "bytes64", 64, seed=0)
        export_saetta(mdat.sequences("bytes64", 64), order, tmp_path / "flat", seed=0)
        reader = mdat.saetta(tmp_path / "flat", "bytes64", 64, None, 0)
        shuffled = mdat.sequences("bytes64", 64)
        assert [s.tolist() for s in reader] == [shuffled[int(i)].tolist() for i in order]
        assert np.array_equal(reader.lengths(), shuffled.lengths()[order])
        mdat.add_records("b", [{"text": "one more document"}])  # the default view grows
        mdat.pretokenize("bytes64")
        with pytest.raises(SaettaError, match=r"flat holds view 'default' as it was when "
                                              r"exported \(fingerprint [0-9a-f]{64}\), and its "
                                              r"data changed since .* export it again"):
            mdat.saetta(tmp_path / "flat", "bytes64", 64, None, 0)
