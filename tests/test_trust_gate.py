"""Issue 30, rows 9 and 14, against real servers on loopback: a SubmitResult message is
checked against the run's layout before any of its tensors is decoded or widened (row 9),
and a close whose safetensors write fails as on a full disk is answered UNAVAILABLE with
the reason, changes nothing, and closes once there is room again (row 14)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

import grpc
import pytest
import safetensors.torch
import torch
from safetensors import SafetensorError
from support.helpers import Clock, run_config, served_run_toml
from support.rounds import assigned, caps, committed, drive, events, flat_results, results
from support.wire import code_of, header_of, joined, serving_config

import matformer.modeling.compression.validation as validation
import matformer.protocol.sparse as sparse_module
from matformer.modeling.compression import ValidResult
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.protocol.sparse import decode_sparse_result, encode_sparse_result
from matformer.protocol.submission import submission_messages
from matformer.server.config import RunConfig
from matformer.server.coordinator import Coordinator
from matformer.server.main import RunningServer

EMBED = "model.embed_tokens.weight"  # (260, 32): 33 × 4 chunks of 8 × 8, positions in int8
TOPK = {"encoding": "topk", "chunk": 8, "topk": 4, "value_dtype": "float32"}
# what safetensors raises when the disk fills during a write (it is no OSError)
DISK_FULL = "Error while serializing: I/O error: No space left on device (os error 28)"


@contextlib.contextmanager
def serving(tmp_path, **tables) -> Iterator[tuple[RunningServer, pb_grpc.CoordinatorStub]]:
    """A one-client served run (helpers.served_run_toml) with ``tables`` replaced."""
    with serving_config(RunConfig.load(served_run_toml(tmp_path, min_clients=1,
                                                       **tables))) as served:
        yield served


# -- row 9: counts and dtypes checked before anything is decoded ---------------------------

def honest_results(server: RunningServer, client_id: str) -> list:
    """``client_id``'s results for its assignment, encoded with the run's settings."""
    c = server.service.coordinator
    compressor = c.config.compression.build()
    assignment = assigned(c, client_id)
    regions = c.regions(assignment.tier)
    return [compressor.encode(name, torch.randn([b - a for a, b in regions[name]]),
                              shape=c.shapes[name], region=regions[name],
                              tokens=assignment.tokens) for name in sorted(c.shapes)]


def hostile(message: pb.SparseResult, field: str, dtype: str, shape: list[int],
            data_bytes: int) -> pb.SparseResult:
    out = pb.SparseResult()
    out.CopyFrom(message)
    tensor = getattr(out, field)
    tensor.dtype, tensor.data = dtype, bytes(data_bytes)
    tensor.shape[:] = shape
    return out


@pytest.fixture
def decoded(monkeypatch) -> list[str]:
    """What each tensor decoded by protocol.sparse is, in order (its ``what``)."""
    seen: list[str] = []
    real = sparse_module.decode_tensor

    def spy(message: pb.Tensor, what: str = "tensor") -> torch.Tensor:
        seen.append(what)
        return real(message, what)

    monkeypatch.setattr(sparse_module, "decode_tensor", spy)
    return seen


def test_narrow_positions_with_counts_off_the_run_are_refused_before_decoding(tmp_path,
                                                                              decoded):
    """The probe: one 48 MiB result whose int8 positions declare 381,300 per chunk (the run
    takes 4) was widened to int64 (+384 MiB) before its values' shape refused it. Now every
    such message is refused before any of its tensors is read, and the honest submission
    after them, narrow positions and all, is decoded and taken."""
    with serving(tmp_path, compression=TOPK, faults={"max_rejections": 0}) as (server, stub):
        member, auth, work = joined(stub, server, "mallory")
        results = honest_results(server, member.client_id)
        embed = encode_sparse_result(next(r for r in results if r.name == EMBED))
        n = embed.chunks.shape[0]
        assert (embed.chunks.dtype, embed.indices.dtype, list(embed.indices.shape)) == (
            "int16", "int8", [n, 4])
        per_chunk = (16 << 20) // n  # 16 MiB of int8 positions: 128 MiB once widened
        attacks = {
            "positions per chunk": hostile(embed, "indices", "int8", [n, per_chunk],
                                           n * per_chunk),
            "chunks past the region": hostile(embed, "chunks", "int8", [4 * n], 4 * n),
            "declared 2^80 positions": hostile(embed, "indices", "int8", [2**40, 2**40], 64),
            "values past topk": hostile(embed, "values", "float32", [n, 5], n * 5 * 4),
            "values of another dtype": hostile(embed, "values", "bfloat16", [n, 4], n * 4 * 2),
        }
        for what, message in attacks.items():
            messages = [pb.SubmitMessage(header=header_of(member, work)),
                        pb.SubmitMessage(result=message)]
            code, details = code_of(lambda m=messages: stub.SubmitResult(
                iter(m), metadata=auth, timeout=60))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, what
            assert f"'{EMBED}' declares" in details and "the run takes at most" in details, what
            assert decoded == [], f"{what}: decoded {decoded}"
        accepted = stub.SubmitResult(submission_messages(header_of(member, work), results),
                                     metadata=auth, timeout=60).accepted
        assert accepted == len(results)
        assert f"sparse result '{EMBED}': indices" in decoded
        committed(server.service.coordinator, 1)


# -- row 14: a safetensors write that fails as on a full disk -----------------------------

def disk_full_at(monkeypatch, folder: str) -> None:
    """Every safetensors write under a ``folder`` of the run directory fails as safetensors
    fails when the disk is full; until the test's monkeypatch is undone."""
    real = safetensors.torch.serialize_file

    def serialize(tensors, filename, metadata=None):
        if f"/{folder}/" in str(filename):
            raise SafetensorError(DISK_FULL)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "serialize_file", serialize)


@pytest.mark.parametrize("folder", ["updates", "checkpoints"])
def test_a_close_whose_safetensors_write_fails_is_said_and_closes_later(
        tmp_path, monkeypatch, folder):
    """The run's one round: its close logs the update and writes the final checkpoint, both
    through safetensors. The close runs on the coordinator's close worker, so the submission
    is taken; the failed close is said once as a disk event, nothing changed on disk, the
    round stays collected with its results, and once there is room the worker closes it."""
    with serving(tmp_path, round={"min_clients": 1, "deadline_s": 30.0,
                                  "tokens_per_round": 1024, "rounds": 1}) as (server, stub):
        member, auth, work = joined(stub, server, "alice")
        c = server.service.coordinator
        state = (c.dir / "state.json").read_text()
        with monkeypatch.context() as patch:
            disk_full_at(patch, folder)
            stub.SubmitResult(
                submission_messages(header_of(member, work), flat_results(c, member.client_id)),
                metadata=auth, timeout=60)
            give_up = time.monotonic() + 60
            while not events(c, "disk") and time.monotonic() < give_up:
                time.sleep(0.02)
            disk = events(c, "disk")
            assert len(disk) == 1 and "No space left on device" in disk[0]["detail"]
            assert "round 0 could not be saved" in disk[0]["detail"]
            assert (c.dir / "state.json").read_text() == state
            assert c.state.round == 0 and member.client_id in c.current_round.submissions
        committed(c, 1)  # room again: the worker's next try closes it
        reply = stub.GetRound(pb.GetRoundRequest(), metadata=auth, timeout=60)
        assert reply.state == pb.ROUND_STATE_FINISHED
        assert c.state.round == 1 and c.state.checkpoints[-1] == 1
        assert (c.dir / "checkpoints" / "round-1" / "model.safetensors").is_file()
        assert len(events(c, "disk")) == 1  # said once, not on every try


def test_a_checkpoint_written_beside_the_rounds_that_fails_so_is_tried_again(
        tmp_path, mdat_path, monkeypatch):
    """The checkpoint a close starts (written while the next rounds go on) failed with
    safetensors' error, which the next close raised as it was: every later submission
    UNKNOWN. Now it is a write failure like any other: said, and the next one tries again."""
    clock = Clock()
    c = Coordinator(run_config(tmp_path / "run", mdat_path), clock=clock)  # every 2 rounds
    cid = c.join(caps("a"))[0].client_id
    with monkeypatch.context() as patch:
        disk_full_at(patch, "checkpoints")
        drive(c, clock, cid, 3)  # round 1's close starts checkpoint round-2, round 2 closes
    assert c.state.round == 3 and c.state.checkpoints == [0]
    assert "checkpoint round-2 could not be written" in events(c, "disk")[0]["detail"]
    assert "No space left on device" in events(c, "disk")[0]["detail"]
    drive(c, clock, cid, 1)  # room again: round 3's close writes checkpoint round-4
    assert c.state.checkpoints == [0, 4]


def test_a_result_is_validated_once_from_the_wire_to_the_close(tmp_path, mdat_path,
                                                               monkeypatch):
    """The decoder validates what it reads (a ValidResult); the gate and the close's
    aggregation take it as it is. A result made in process is validated by the gate, once."""
    checked: list[str] = []
    real, batched = validation._check, validation._checked
    monkeypatch.setattr(validation, "_check",
                        lambda result: (checked.append(result.name), real(result))[1])
    # results checked together (validate_all) are made valid here, after one check of all
    monkeypatch.setattr(validation, "_checked",
                        lambda result: (checked.append(result.name), batched(result))[1])
    clock = Clock()
    c = Coordinator(run_config(tmp_path / "run", mdat_path), clock=clock)
    cid = c.join(caps("alice", tier=1))[0].client_id
    tier = assigned(c, cid).tier
    sent = results(c, cid)
    layouts = c.layouts.of(tier)
    decoded = [decode_sparse_result(encode_sparse_result(r), layouts[r.name]) for r in sent]
    assert all(isinstance(r, ValidResult) for r in decoded)
    assert sorted(checked) == sorted(r.name for r in sent)  # by the decoder
    clock.now += 1.0
    c.submit(cid, c.current_round.index, decoded, loss=1.0)
    c.flush()
    assert c.state.round == 1 and sorted(checked) == sorted(r.name for r in sent)
    checked.clear()
    clock.now += 1.0
    c.submit(cid, c.current_round.index, results(c, cid), loss=1.0)  # made in process
    c.flush()
    assert c.state.round == 2 and sorted(checked) == sorted(r.name for r in sent)
