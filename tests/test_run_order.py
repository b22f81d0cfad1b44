"""One definition of a run's order (issue 33, item 2): which sequences a run trains, in what
order over epochs, and which it holds out, shared by standalone training, the coordinator,
``matformer-eval``, the testnet and the ledger's audit. A federated run longer than its data
goes into fresh epoch orders and never trains its held-out tail."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
from support.helpers import Clock, run_config
from support.models import tiny_config
from support.rounds import caps, drive

from matformer.client.epochs import Epochs
from matformer.local_testnet.held_out import HeldOut
from matformer.modeling.errors import BatchError
from matformer.modeling.mdat import DEFAULT_STRATEGY, Mdat
from matformer.modeling.run_order import RunOrder
from matformer.server.coordinator import Coordinator
from matformer.server.ledger import TrainedLedger, audit_run
from matformer.server.work import work_order


def test_epochs_are_fresh_orders_of_the_same_training_ids_and_never_the_held_out_tail():
    config = tiny_config()
    lengths = np.full(100, 50)
    lengths[[7, 8]] = 1  # one-token documents carry no target
    shuffle = np.random.default_rng(0).permutation(100)
    order = RunOrder.of(shuffle, lengths, config, seed=3)
    candidates = [int(i) for i in shuffle if i not in (7, 8)]
    assert order.candidates == 98 and order.held_out.tolist() == candidates[-4:]  # 5%
    assert order.training.tolist() == candidates[:-4]  # epoch 0: the shuffle's order
    epochs = [order.epoch(n) for n in range(3)]
    for ids in epochs:
        assert sorted(ids.tolist()) == sorted(order.training.tolist())
    assert epochs[1].tolist() != epochs[0].tolist() != epochs[2].tolist()
    assert [order.at(p) for p in range(94, 100)] == epochs[1][:6].tolist()
    again = RunOrder.of(shuffle, lengths, config, seed=3)  # the same every time
    assert again.epoch(2).tolist() == epochs[2].tolist()
    handed = order.handed_out(94 + 10)  # one epoch and ten ids
    assert {handed[i] for i in epochs[1][:10].tolist()} == {2}
    assert {handed[i] for i in epochs[1][10:].tolist()} == {1}
    assert not any(handed[int(i)] for i in order.held_out)
    # the legacy order: the same every epoch, nothing held out
    fixed = RunOrder.fixed(candidates)
    assert fixed.epoch(5).tolist() == candidates and len(fixed.held_out) == 0


def test_too_little_data_is_named_in_one_error():
    with pytest.raises(BatchError, match="at least one sequence to train on besides"):
        RunOrder.of(np.arange(1), np.full(1, 50), tiny_config(), seed=0)


def test_standalone_epochs_take_the_run_order(tmp_path, mdat_path):
    """matformer-train's steps cover each epoch of the order once, epoch after epoch (its
    batches grouped by length within the epoch's order)."""
    args = argparse.Namespace(batching="padded", batch_tokens=512, seq_len=128, steps=None,
                              epochs=2, seed=0)
    with Mdat.open(mdat_path) as mdat:
        reader, order = RunOrder.open(mdat, DEFAULT_STRATEGY["strategy_name"], 128, None, 0,
                                      tiny_config())
    epochs = Epochs(order, reader.lengths(), args)
    seen = [[int(i) for i in epochs.step(k)[0]] for k in range(epochs.steps())]
    first = len(epochs.epoch(0)[1])
    assert sorted(i for ids in seen[:first] for i in ids) == sorted(order.training.tolist())
    assert sorted(i for ids in seen[first:] for i in ids) == sorted(order.training.tolist())
    assert seen[first:] != seen[:first]  # batches of a fresh order
    assert not set(i for ids in seen for i in ids) & set(order.held_out.tolist())


def test_a_federated_run_longer_than_its_data_never_trains_its_held_out_tail(
        tmp_path, mdat_path):
    clock = Clock()
    config = run_config(tmp_path / "run", mdat_path, tokens_per_round=4096)
    c = Coordinator(config, clock=clock)
    cid = c.join(caps("a", tier=1))[0].client_id
    order = c.queue.order
    assert c.state.held_out == len(order.held_out) > 0
    rounds = 0
    while c.queue.position < 2.5 * len(order.training):  # into the third epoch
        drive(c, clock, cid, 1)
        rounds += 1
    trained = [e["ids"] for e in TrainedLedger(config.run.dir).rounds()]
    flat = [i for ids in trained for i in ids]
    assert not set(flat) & set(order.held_out.tolist())
    epoch_size = len(order.training)
    assert flat[:epoch_size] == order.epoch(0).tolist()
    assert flat[epoch_size:2 * epoch_size] == order.epoch(1).tolist()  # a fresh order
    assert order.epoch(1).tolist() != order.epoch(0).tolist()
    result = audit_run(config)
    assert result.exactly_once and result.passes_complete == 2 and not result.held_out_trained
    # the testnet's and matformer-eval's held-out sequences are this very tail
    with Mdat.open(mdat_path) as mdat:
        reader, again = work_order(mdat, config)
    assert again.held_out.tolist() == order.held_out.tolist()
    held = HeldOut.of(config)
    assert [e.tolist() for e in held.examples] == [
        reader[int(i)].astype(np.int64).tolist() for i in order.held_out[-len(held.examples):]]


def test_the_audit_names_a_held_out_sequence_that_was_trained(tmp_path, mdat_path):
    clock = Clock()
    config = run_config(tmp_path / "run", mdat_path)
    c = Coordinator(config, clock=clock)
    cid = c.join(caps("a", tier=1))[0].client_id
    drive(c, clock, cid, 2)
    ledger = TrainedLedger(config.run.dir)
    sneaked = int(c.queue.order.held_out[0])
    ledger.record(2, [sneaked])  # as a coordinator that handed out its tail would
    result = audit_run(config)
    assert result.held_out_trained == [sneaked] and not result.exactly_once
    assert "1 held out but trained" in result.summary()
