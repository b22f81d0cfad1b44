"""The close sharded over torch.distributed (issue 48, item 4; server/shards.py): with
``[coordinator] shards = 2`` the coordinator starts two processes, which join it in one Gloo
group, and each closes its half of the parameters. Under DiLoCo's outer Nesterov momentum
and a compressed broadcast (the state a close carries), a sharded run is bit for bit the
one-process run: weights, every round's hashes, the residual and the momentum; its
checkpoints resume on any shard count; a shard killed mid-close fails the round with
nothing committed, and the run resumes exactly after a restart."""

from __future__ import annotations

import math
import socket
import subprocess
import sys
import threading
from typing import Any

import pytest
import torch
from support.helpers import Clock, run_tables
from support.models import tiny_config
from support.rounds import caps, drive, same

from matformer.modeling.checkpoint.export import read_manifest
from matformer.modeling.checkpoint.files import read_names, read_weights, write_weights
from matformer.modeling.checkpoint.manifest import sha256_of
from matformer.modeling.compression import tier_regions, universal_shapes
from matformer.modeling.compression.hashing import (
    combine_digests,
    layout_of,
    region_digests,
    tier_hashes,
)
from matformer.modeling.errors import CheckpointError
from matformer.server.checkpoints import CheckpointStore
from matformer.server.close import CloseWorker
from matformer.server.config import RunConfig
from matformer.server.coordinator import Coordinator
from matformer.server.outer_state import load_carried
from matformer.server.shards import EMBEDDING, FAULT_ENV, TIED_HEAD, ShardLost, partition

ROUNDS = 6


def sharded_config(run_dir, mdat_path, shards: int, **coordinator: Any) -> RunConfig:
    """Local steps (DiLoCo's outer SGD: momentum 0.9, Nesterov), a broadcast of 8 DCT
    coefficients per 16 × 16 chunk, checkpoints every 2 rounds, the close over ``shards``."""
    return RunConfig.from_dict(run_tables(
        mdat_path, run={"id": "sharded", "dir": str(run_dir)},
        round={"min_clients": 1, "deadline_s": 10.0, "tokens_per_round": 1024, "rounds": 20},
        checkpoint={"every_rounds": 2}, inner={"batch_tokens": 256},
        update={"broadcast_topk": 8}, compression={"encoding": "dense", "chunk": 16},
        coordinator={"shards": shards, **coordinator}))


def run(config: RunConfig, rounds: int, clock: Clock, *, start: Coordinator | None = None
        ) -> Coordinator:
    """``rounds`` rounds of one tier-1 member (a resumed coordinator's member again)."""
    c = start or Coordinator(config, clock=clock)
    if start is None:
        cid = c.join(caps("a", tier=1))[0].client_id
    else:
        cid = next(iter(c.membership.members))
        c.advance()
    drive(c, clock, cid, rounds)
    return c


def logged_hashes(c: Coordinator) -> list[dict[int, str]]:
    return [c.log.read(r).hashes for r in range(c.state.checkpoints[-2], c.state.round)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, mdat_path):
    """The reference: the run closed in one process."""
    c = run(sharded_config(tmp_path_factory.mktemp("one"), mdat_path, 1), ROUNDS, Clock())
    assert c.carried.momentum and c.carried.residual
    yield c
    c.close()


def final_checkpoint(c: Coordinator):
    path = c.checkpoints.path(c.state.checkpoints[-1])
    assert c.state.checkpoints[-1] == ROUNDS
    return c.checkpoints.read(ROUNDS), load_carried(path)


def test_digests_of_parts_combine_into_the_hashes_of_the_whole():
    config = tiny_config(vocab_size=260, max_position_embeddings=128)
    shapes = universal_shapes(config)
    gen = torch.Generator().manual_seed(0)
    state = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    regions = {t: tier_regions(shapes, config, t) for t in (0, 1, 2)}
    whole = tier_hashes(state, regions)
    for parts in (partition(shapes, 2, tied=False), partition(shapes, 5, tied=False)):
        digests = {}
        for part in parts:
            digests.update(region_digests({n: state[n] for n in part}, regions))
        assert combine_digests(layout_of(state), regions, digests) == whole
    state["model.norm.weight"][0] += 1.0
    assert tier_hashes(state, regions)[2] != whole[2]


def test_parts_are_contiguous_balanced_and_a_tied_head_stays_with_its_embedding():
    config = tiny_config(vocab_size=260, max_position_embeddings=128)
    shapes = universal_shapes(config)
    names = list(shapes)
    for count in (2, 3):
        parts = partition(shapes, count, tied=False)
        assert [n for part in parts for n in part] == names  # contiguous, in model order
        sizes = [sum(math.prod(shapes[n]) for n in part) for part in parts]
        biggest = max(math.prod(s) for s in shapes.values())
        assert max(sizes) - min(sizes) <= 2 * biggest
    tied = dict(shapes) | {TIED_HEAD: shapes[EMBEDDING]}
    parts = partition(tied, 2, tied=True)
    assert any(TIED_HEAD in part and EMBEDDING in part for part in parts)
    with pytest.raises(ValueError, match="at most"):
        partition({"a": (2,), "b": (2,)}, 3, tied=False)


def test_two_shards_close_bit_for_bit_as_one_process(tmp_path, mdat_path, one_process):
    sharded = run(sharded_config(tmp_path / "two", mdat_path, 2), ROUNDS, Clock())
    try:
        assert sharded.shards is not None and len(sharded.shards.processes) == 2
        assert logged_hashes(sharded) == logged_hashes(one_process)
        assert same(dict(sharded.master.items()), one_process.master)
        # the shards wrote the checkpoint side by side; it reads back whole
        folder = sharded.checkpoints.path(ROUNDS)
        assert sorted(p.name for p in folder.glob("model-*.safetensors")) == [
            "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        weights, carried = final_checkpoint(sharded)
        reference_weights, reference_carried = final_checkpoint(one_process)
        assert same(weights, reference_weights)
        # the tier slices too, each shard writing its part: the same tensors, listed with
        # their digests in the manifest a member checks its download against
        reference = one_process.checkpoints.path(ROUNDS)
        assert same(read_weights(folder / "tier1"), read_weights(reference / "tier1"))
        manifest = read_manifest(folder)
        listed = next(t.files for t in manifest.tiers if t.tier == 1)
        assert listed == ["tier1/config.json", "tier1/model.safetensors.index.json",
                          "tier1/model-00001-of-00002.safetensors",
                          "tier1/model-00002-of-00002.safetensors"]
        assert all(manifest.sha256[f] == sha256_of(folder / f) for f in listed)
        assert same(carried.momentum, one_process.carried.momentum)
        assert same(carried.residual, reference_carried.residual)
    finally:
        sharded.close()
    assert [p.poll() for p in sharded.shards.processes] == [0, 0]  # both stopped cleanly


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_a_run_resumes_on_another_shard_count(tmp_path, mdat_path, one_process, before, after,
                                              monkeypatch):
    clock = Clock()
    first = run(sharded_config(tmp_path / "run", mdat_path, before), 3, clock)
    first.close()
    if after > 1:  # each shard reads and replays its own part; the root reads no weights
        monkeypatch.setattr(CheckpointStore, "read", refuse)
        monkeypatch.setattr(CheckpointStore, "read_carried", refuse)
    resumed = Coordinator(sharded_config(tmp_path / "run", mdat_path, after), clock=clock)
    monkeypatch.undo()
    try:
        assert resumed.state.round == 3 and resumed.state.checkpoints == [0, 2]
        run(resumed.config, ROUNDS - 3, clock, start=resumed)
        assert logged_hashes(resumed) == logged_hashes(one_process)
        assert same(dict(resumed.master.items()), one_process.master)
        weights, carried = final_checkpoint(resumed)
        assert same(weights, final_checkpoint(one_process)[0])
        assert same(carried.momentum, one_process.carried.momentum)
        assert same(carried.residual, one_process.carried.residual)
    finally:
        resumed.close()


def refuse(*_, **__):
    raise AssertionError("the root read a whole checkpoint")


def test_a_shard_killed_mid_close_fails_the_round_and_the_run_resumes_exactly(
        tmp_path, mdat_path, one_process, monkeypatch):
    config = sharded_config(tmp_path / "run", mdat_path, 2)
    monkeypatch.setenv(FAULT_ENV, "exit-in-close:4")  # each shard's 4th close: round 3
    clock = Clock()
    first = run(config, 3, clock)
    cid = next(iter(first.membership.members))
    ledger = first.ledger.size()
    with pytest.raises(ShardLost, match=r"exit code 17.*not committed.*Restart the server"):
        drive(first, clock, cid, 1)
    # nothing of round 3 was committed: not the counter, not the log, not the ledger
    assert first.state.round == 3 and first.ledger.size() == ledger
    assert [p.name for p in sorted(first.log.directory.glob("round-3*"))] == []
    with pytest.raises(ShardLost):  # no later close either, until a restart
        first.advance()
        drive(first, clock, cid, 1)
    first.close()
    monkeypatch.delenv(FAULT_ENV)

    resumed = Coordinator(config, clock=clock)
    try:
        assert resumed.state.round == 3
        run(config, ROUNDS - 3, clock, start=resumed)
        assert logged_hashes(resumed) == logged_hashes(one_process)
        assert same(dict(resumed.master.items()), one_process.master)
    finally:
        resumed.close()


def test_the_close_worker_stops_for_good_when_a_shard_is_lost():
    def lost():
        raise ShardLost("shard 1 left")

    worker = CloseWorker(lost)
    thread = threading.Thread(target=worker.run, args=(threading.Event(),))
    thread.start()
    worker.wake()
    thread.join(timeout=30)
    assert not thread.is_alive() and str(worker.fatal) == "shard 1 left"


def test_a_shard_reads_its_names_alone_from_one_file_or_from_shards(tmp_path):
    state = {f"w{i}": torch.full((4, 4), float(i)) for i in range(6)}
    for folder, shard_bytes in ((tmp_path / "one", None), (tmp_path / "sharded", 128)):
        folder.mkdir()
        write_weights(state, folder, shard_bytes)
        assert same(read_names(folder, ["w1", "w4"]), {"w1": state["w1"], "w4": state["w4"]})
        with pytest.raises(CheckpointError, match="holds no w9"):
            read_names(folder, ["w1", "w9"])
    assert len(list((tmp_path / "sharded").glob("model-*"))) == 3  # two tensors each


def test_shards_started_elsewhere_join_the_coordinator_and_close_alike(tmp_path, mdat_path,
                                                                      one_process):
    """``[coordinator] shard_host``: the coordinator starts no shard; it waits for shards
    started by hand (here two processes standing for two machines), which close the same
    bits; a stopped coordinator sends them home."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    shards = [subprocess.Popen([sys.executable, "-m", "matformer.scripts.verbs", "shard",
                                "--coordinator", f"127.0.0.1:{port}", "--rank", str(rank),
                                "--count", "2", "--threads", "1"]) for rank in (1, 2)]
    try:
        config = sharded_config(tmp_path / "run", mdat_path, 2, shard_host="127.0.0.1",
                                shard_port=port, shard_wait_s=120.0)
        c = run(config, ROUNDS, Clock())
        try:
            assert c.shards is not None and c.shards.processes == []
            assert logged_hashes(c) == logged_hashes(one_process)
        finally:
            c.close()
        assert [p.wait(timeout=60) for p in shards] == [0, 0]
    finally:
        for p in shards:
            p.kill()


def test_a_coordinator_whose_shards_never_come_says_which_and_how_to_start_them(
        tmp_path, mdat_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    config = sharded_config(tmp_path / "run", mdat_path, 2, shard_host="127.0.0.1",
                            shard_port=port, shard_wait_s=1.0)
    with pytest.raises(ShardLost, match=r"shard\(s\) 1, 2 of 2 did not join within 1 s; "
                                        r"start them \(matformer shard\)"):
        Coordinator(config, clock=Clock())
