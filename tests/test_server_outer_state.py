"""The outer state survives a restart (issue 33, item 1): under local steps with DiLoCo's
outer Nesterov momentum and a compressed broadcast, a coordinator killed at any point of a
round's close, or between rounds, and restarted ends bit for bit where the run that was
never interrupted ends: weights, the broadcast's residual and the momentum buffer."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import save_file
from support.helpers import Clock, run_tables
from support.rounds import caps, drive, same

import matformer.server.checkpoints as checkpoints_module
import matformer.server.update_log as update_log_module
from matformer.modeling.checkpoint.export import read_manifest
from matformer.modeling.compression import CompressionConfig, SparseResult
from matformer.server.config import RunConfig
from matformer.server.coordinator import Coordinator
from matformer.server.ledger import TrainedLedger
from matformer.server.outer_state import (
    OUTER_STATE_NAME,
    load_carried,
    results_from,
    results_record,
)
from matformer.server.state import RunState
from matformer.server.update_steps import ARITHMETIC

ROUNDS = 6


def outer_config(run_dir, mdat_path, broadcast_bits: int = 8) -> RunConfig:
    """Local steps (so [update] takes DiLoCo's outer SGD: lr 0.7, momentum 0.9, Nesterov)
    and a broadcast of 8 DCT coefficients per 16 × 16 chunk; checkpoints every 2 rounds."""
    return RunConfig.from_dict(run_tables(
        mdat_path, run={"id": "outer", "dir": str(run_dir)},
        round={"min_clients": 1, "deadline_s": 10.0, "tokens_per_round": 1024, "rounds": 20},
        checkpoint={"every_rounds": 2}, inner={"batch_tokens": 256},
        update={"broadcast_topk": 8, "broadcast_bits": broadcast_bits},
        compression={"encoding": "dense", "chunk": 16}))


class Crash(BaseException):
    """Stands for kill -9: nothing after the crash point runs."""


def crash(*_, **__):
    raise Crash


@pytest.fixture(scope="module")
def straight(tmp_path_factory, mdat_path):
    clock = Clock()
    c = Coordinator(outer_config(tmp_path_factory.mktemp("straight"), mdat_path), clock=clock)
    cid = c.join(caps("a", tier=1))[0].client_id
    drive(c, clock, cid, ROUNDS)
    update = c.config.update
    assert (update.rule, update.lr, update.momentum, update.nesterov) == ("sgd", 0.7, 0.9, True)
    assert c.carried.momentum and c.carried.residual  # both carried, neither zero
    assert all(t.abs().sum() > 0 for t in [*c.carried.momentum.values(),
                                           *c.carried.residual.values()])
    return c, cid


CRASHES = {  # where round 3's close is killed; it writes checkpoint round-4
    "between rounds": None,  # round 3 is open, nothing of it written
    "update log": (update_log_module, "write_json_atomic"),  # inputs and steps, no json
    "outer state": (checkpoints_module, "save_carried"),  # weights and slices staged
    "slices": (checkpoints_module, "export_tiers"),
    "state.json": (RunState, "save"),
    "ledger": (TrainedLedger, "record"),
}


@pytest.mark.parametrize("point", CRASHES)
def test_a_kill_anywhere_resumes_weights_residual_and_momentum_bit_for_bit(
        tmp_path, mdat_path, monkeypatch, straight, point):
    reference, cid = straight
    clock = Clock()
    config = outer_config(tmp_path / "run", mdat_path)
    first = Coordinator(config, clock=clock)
    assert first.join(caps("a", tier=1))[0].client_id == cid
    drive(first, clock, cid, 3)
    if CRASHES[point] is not None:
        with monkeypatch.context() as patch:
            patch.setattr(*CRASHES[point], crash)
            with pytest.raises(Crash):
                drive(first, clock, cid, 1)
    del first

    resumed = Coordinator(config, clock=clock)
    assert resumed.state.checkpoints == [0, 2] and resumed.state.round in (3, 4)
    resumed.advance()
    drive(resumed, clock, cid, ROUNDS - resumed.state.round)
    assert same(resumed.master, reference.master)
    assert same(resumed.carried.residual, reference.carried.residual)
    assert same(resumed.carried.momentum, reference.carried.momentum)


@pytest.mark.parametrize("bits", [4, 2])
def test_a_restart_resumes_a_broadcast_of_fewer_bits_bit_for_bit(tmp_path, mdat_path, bits):
    """The update log records each round's broadcast_bits: a resume closes the logged
    rounds again with the levels they were closed with (the chaos testnet once found the
    replay at int8 levels not reproducing the logged hashes)."""
    masters = []
    for name, stop in (("straight", None), ("restarted", 3)):
        clock = Clock()
        config = outer_config(tmp_path / name, mdat_path, broadcast_bits=bits)
        c = Coordinator(config, clock=clock)
        cid = c.join(caps("a", tier=1))[0].client_id
        drive(c, clock, cid, stop or 5)
        if stop:
            del c
            c = Coordinator(config, clock=clock)
            c.advance()
            drive(c, clock, cid, 5 - c.state.round)
        masters.append((c.master, c.carried.residual))
    assert same(masters[0][0], masters[1][0]) and same(masters[0][1], masters[1][1])
    record = json.loads((config.run.dir / "updates" / "round-4.json").read_text())
    assert record["broadcast_bits"] == bits


def test_the_outer_state_is_saved_with_each_checkpoint_and_served_to_no_one(straight):
    c, _ = straight
    latest = c.latest_checkpoint().path
    saved = load_carried(latest)
    assert saved is not None and saved.momentum.keys() == c.master.keys()
    assert saved.residual.keys() == c.master.keys()
    manifest = read_manifest(latest)
    listed = {f for tier in manifest.tiers for f in tier.files} | set(manifest.common_files)
    assert OUTER_STATE_NAME not in listed and not (latest / "tier1" / OUTER_STATE_NAME).exists()
    # the log holds each round's inputs since the checkpoint before the latest
    logged = sorted(p.name for p in (c.dir / "updates").glob("*.inputs.safetensors"))
    since = c.state.checkpoints[-2]
    assert logged == [f"round-{r}.inputs.safetensors" for r in range(since, ROUNDS)]


def test_a_checkpoint_from_before_outer_state_resumes_from_zero_saying_so_once(
        tmp_path, mdat_path, caplog):
    clock = Clock()
    config = outer_config(tmp_path / "run", mdat_path)
    c = Coordinator(config, clock=clock)
    cid = c.join(caps("a", tier=1))[0].client_id
    drive(c, clock, cid, 3)
    # as an earlier version left it: no outer state, no logged inputs
    (c.dir / "checkpoints" / "round-2" / OUTER_STATE_NAME).unlink()
    (c.dir / "updates" / "round-2.inputs.safetensors").unlink()
    entry = json.loads((c.dir / "updates" / "round-2.json").read_text())
    del entry["inputs"], entry["outer"]
    (c.dir / "updates" / "round-2.json").write_text(json.dumps(entry))
    resumed = resumed_from_zero(config, clock, caplog, c.master,
                                "checkpoint round-2 holds no outer state")
    resumed.advance()
    drive(resumed, clock, cid, 1)  # and it trains on
    assert resumed.state.round == 4


def test_outer_state_of_the_first_close_arithmetic_resumes(tmp_path, mdat_path, caplog):
    """A checkpoint holding the momentum as values (version 1) resumes with it taken to the
    coefficients the close keeps it in now; a round logged by the first arithmetic is
    applied from its steps, and the carried state starts again from zero, said once."""
    clock = Clock()
    config = outer_config(tmp_path / "run", mdat_path)
    c = Coordinator(config, clock=clock)
    cid = c.join(caps("a", tier=1))[0].client_id
    drive(c, clock, cid, 2)
    assert c.state.checkpoints == [0, 2] and c.state.round == 2
    folder = c.dir / "checkpoints" / "round-2"
    broadcast = config.update.build(2, config.round.planned_rounds,
                                    config.compression).build().broadcast
    saved = load_carried(folder, broadcast)
    shapes = {name: tensor.shape for name, tensor in c.master.items()}
    save_file({**{f"residual/{n}": t for n, t in saved.residual.items()},
               **{f"momentum/{n}": broadcast.values_of(t, shapes[n]).contiguous()
                  for n, t in saved.momentum.items()}},
              str(folder / OUTER_STATE_NAME), metadata={"format": "matformer-outer-state",
                                                        "version": "1"})
    resumed = Coordinator(config, clock=clock)
    assert same(resumed.carried.residual, c.carried.residual)
    for name, momentum in resumed.carried.momentum.items():
        torch.testing.assert_close(momentum, c.carried.momentum[name], atol=1e-5, rtol=1e-4)

    drive(c, clock, cid, 1)  # round 2, logged with its inputs; as the first arithmetic had it:
    entry = json.loads((c.dir / "updates" / "round-2.json").read_text())
    assert entry["outer"].pop("arithmetic") == ARITHMETIC
    (c.dir / "updates" / "round-2.json").write_text(json.dumps(entry))
    resumed_from_zero(config, clock, caplog, c.master,
                      "round 2 was closed by an earlier version's arithmetic")


def resumed_from_zero(config, clock, caplog, master, why) -> Coordinator:
    """A coordinator resumed where the outer state cannot be rebuilt: it says ``why`` once,
    holds ``master`` (from the logged steps) and carries nothing."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="matformer.server"):
        resumed = Coordinator(config, clock=clock)
    said = [r.getMessage() for r in caplog.records if "start again from zero" in r.getMessage()]
    assert len(said) == 1 and why in said[0]
    assert same(resumed.master, master)
    assert resumed.carried.momentum == {} and resumed.carried.residual == {}
    return resumed


def test_a_rounds_inputs_round_trip_in_a_few_flat_tensors_and_the_earlier_layouts_still_read():
    compressor = CompressionConfig(encoding="dct", chunk=16, topk=4).build()
    gen = torch.Generator().manual_seed(0)
    by_name = {
        "w": [compressor.encode("w", torch.randn(32, 16, generator=gen), shape=(48, 16),
                                region=((0, 32), (0, 16)), tokens=7),
              compressor.encode("w", torch.randn(48, 16, generator=gen), shape=(48, 16),
                                region=((0, 48), (0, 16)), tokens=9)],
        "b": [SparseResult(name="b", shape=(5,), region=((0, 5),), encoding="dense",
                           chunk=(), chunks=torch.zeros(0, dtype=torch.int64),
                           indices=torch.zeros(0, dtype=torch.int64),
                           values=torch.randn(5, dtype=torch.float64), tokens=3)]}
    tensors, meta = results_record(by_name)
    assert sorted(tensors) == ["chunks", "indices", "values/bfloat16", "values/float64"]
    assert tensors["chunks"].dtype == torch.int8 and tensors["indices"].dtype == torch.int16
    assert set(meta) == {"w", "b"} and [len(meta[n]["results"]) for n in "wb"] == [2, 1]
    # the layouts of runs logged before: fields per result (each tensor's offset in the
    # flat ones), and three tensors per result
    fields = {name: [{"shape": list(r.shape), "region": [list(x) for x in r.region],
                      "encoding": r.encoding, "chunk": list(r.chunk), "tokens": r.tokens}
                     for r in rs] for name, rs in by_name.items()}
    second, ends = {}, {}
    for name, rs in by_name.items():
        for r, entry in zip(rs, fields[name], strict=True):
            for field in ("chunks", "indices", "values"):
                tensor = getattr(r, field)
                key = field if field != "values" else f"values/{r.values.dtype}"
                at = ends.get(key, 0)
                second.setdefault(key, []).append(tensor.reshape(-1))
                entry[field] = [key, at, list(tensor.shape)]
                ends[key] = at + tensor.numel()
    second = {key: torch.cat(parts) for key, parts in second.items()}
    first = {f"{name}/{j}/{field}": getattr(r, field) for name, rs in by_name.items()
             for j, r in enumerate(rs) for field in ("chunks", "indices", "values")}
    first_meta = {name: [{k: v for k, v in entry.items()
                          if k not in ("chunks", "indices", "values")} for entry in entries]
                  for name, entries in fields.items()}
    for read in (results_from(tensors, meta), results_from(second, fields),
                 results_from(first, first_meta)):
        assert read.keys() == by_name.keys()
        for name, results in by_name.items():
            for ours, theirs in zip(read[name], results, strict=True):
                assert (ours.shape, ours.region, ours.encoding, ours.chunk, ours.tokens) == (
                    theirs.shape, theirs.region, theirs.encoding, theirs.chunk, theirs.tokens)
                for field in ("chunks", "indices", "values"):
                    assert torch.equal(getattr(ours, field), getattr(theirs, field))
