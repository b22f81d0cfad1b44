"""The round update every side shares (modeling.compression.steps/update, protocol.updates,
server.update_log): the compressed broadcast decodes to the same bits whatever the thread
count or path, carries what it leaves out, is small, and survives the wire and the log."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from matformer.modeling.compression import (
    Broadcast,
    CoefficientStep,
    CompressionConfig,
    RoundUpdate,
    UpdateConfig,
    full_region,
    pack_bits,
    region_slices,
    unpack_bits,
)
from matformer.modeling.compression.dct import LEVEL_MAX, dct_matrix, exact_bits, integer_dct_matrix
from matformer.modeling.errors import CompressionConfigError
from matformer.protocol.errors import MalformedStream
from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
from matformer.protocol.updates import (
    carries_values,
    decode_step,
    encode_step,
    read_updates,
    update_messages,
)
from matformer.server.aggregation import aggregate
from matformer.server.update_log import UpdateLog
from matformer.server.update_steps import Carried, close_round, update_step

UP = "model.layers.0.mlp.up_proj.weight"
SHAPE = (192, 130)  # FFN rows × hidden: partial edge chunks along both dimensions
TIERS = {0: ((0, 192), (0, 130)), 1: ((0, 96), (0, 130)), 2: ((0, 48), (0, 130))}
NORM, NORM_SHAPE = "model.norm.weight", (130,)


def _results(seed: int = 0):
    """Tier 0, 1 and 2 results of UP (DCT, chunk 64) and a dense norm result."""
    torch.manual_seed(seed)
    compressor = CompressionConfig(encoding="dct", chunk=64, topk=32).build()
    ups = [compressor.encode(UP, torch.randn(r[0][1], r[1][1]), shape=SHAPE, region=r,
                             tokens=100 * (tier + 1)) for tier, r in TIERS.items()]
    dense = CompressionConfig(encoding="dense").build()
    norm = dense.encode(NORM, torch.randn(NORM_SHAPE), shape=NORM_SHAPE,
                        region=((0, 130),), tokens=600)
    return {UP: ups, NORM: [norm]}


MASTER = {UP: torch.randn(SHAPE, generator=torch.Generator().manual_seed(1)),
          NORM: torch.randn(NORM_SHAPE, generator=torch.Generator().manual_seed(2))}


def _update(rule="sign", topk=48, residual=None, seed=0):
    """A round closed by the coordinator's code: its record and the residual after it."""
    config = UpdateConfig(rule=rule, lr=0.01, weight_decay=0.1, broadcast_topk=topk, chunk=64)
    _, steps, carried = close_round(config.build(), MASTER, _results(seed),
                                   Carried(residual=residual or {}))
    return RoundUpdate(round=3, update=config, steps=steps, hashes={0: "ab" * 32}), carried.residual


def test_the_integer_dct_is_the_dct_to_its_fraction_bits():
    for n in (1, 2, 64):
        bits = exact_bits((n, n))
        approx = integer_dct_matrix(n, bits) / 2.0**bits
        assert (approx - dct_matrix(n, torch.float64)).abs().max() <= 2.0 ** -(bits + 1)
    assert exact_bits((64, 64)) == 17 and 4096 * LEVEL_MAX * 2 ** 34 < 2**53


def test_the_broadcast_decode_is_exact_integer_arithmetic():
    """float64 BLAS gives the same integers as an int64 reference, so any summation order
    (thread count, BLAS, machine) gives the same bits."""
    (update, _) = _update()
    step = update.steps[UP]
    assert isinstance(step, CoefficientStep)
    bits = exact_bits(step.chunk)
    grid = step.grid
    levels = torch.zeros((len(step.levels), grid.chunk_numel), dtype=torch.int64)
    levels.scatter_(1, step.positions, step.levels.long())
    levels = levels.reshape(-1, *step.chunk)
    m0, m1 = (integer_dct_matrix(n, bits).long() for n in step.chunk)
    reference = torch.einsum("ai,nab,bj->nij", m0, levels, m1)  # int64: exact by definition
    from matformer.modeling.compression.dct import exact_idct
    assert torch.equal(exact_idct(levels, bits), reference.double())


def test_broadcast_decode_is_bit_identical_across_thread_counts_and_paths():
    threads = torch.get_num_threads()
    try:
        directions = []
        for n in (1, 2):
            torch.set_num_threads(n)
            update, _ = _update()
            directions.append({t: update.steps[UP].direction(r) for t, r in TIERS.items()})
    finally:
        torch.set_num_threads(threads)
    update, _ = _update()
    logged = update  # and through the wire and a cut, below
    wire = list(read_updates(update_messages([update.cut(0, {UP: TIERS[0], NORM: ((0, 130),)})])))
    for tier, region in TIERS.items():
        assert torch.equal(directions[0][tier], directions[1][tier])
        cut = logged.steps[UP].cut(region)
        assert torch.equal(cut.direction(region), directions[0][tier])  # a tier's download
        assert torch.equal(wire[0].steps[UP].direction(region), directions[0][tier])
        full = directions[0][0][region_slices(region)]
        assert torch.equal(full, directions[0][tier])  # a slice is the master's slice


@pytest.mark.parametrize("rule", ["sign", "sgd"])
def test_every_tier_applying_its_download_holds_the_masters_slice(rule):
    config = UpdateConfig(rule=rule, lr=0.01, weight_decay=0.1, broadcast_topk=48, chunk=64)
    master = MASTER
    after, steps, _ = close_round(config.build(), master, _results())
    update = RoundUpdate(round=3, update=config, steps=steps, hashes={})
    assert all(torch.equal(after[n], t) for n, t in update.apply(master).items())  # replayed
    for tier, region in TIERS.items():
        regions = {UP: region, NORM: ((0, 130),)}
        mine = {name: master[name][region_slices(regions[name])].clone() for name in master}
        (download,) = read_updates(update_messages([update.cut(tier, regions)]), tier=tier)
        got = download.apply(mine, regions)
        for name in master:
            assert torch.equal(got[name], after[name][region_slices(regions[name])]), (tier, name)


def test_the_residual_carries_exactly_what_the_broadcast_left_out():
    """Over rounds, what replicas applied plus what is still pending equals the sum of the
    aggregates: error feedback loses nothing."""
    rule = UpdateConfig(rule="sgd", lr=1.0, broadcast_topk=48, chunk=64).build()
    residual, sent, total = {}, torch.zeros(SHAPE), torch.zeros(SHAPE)
    for seed in range(3):
        results = _results(seed)[UP]
        agg = aggregate(results)
        step, residual[UP] = update_step(rule, agg, [r.region for r in results],
                                       residual.get(UP))
        sent += step.direction(full_region(SHAPE))
        total += agg.values
    torch.testing.assert_close(sent + residual[UP], total, atol=1e-5, rtol=0)
    assert residual[UP].abs().sum() > 0  # 48 of 4096 coefficients: much was left out


def test_a_compressed_step_is_a_fraction_of_a_byte_per_element():
    update, _ = _update()
    step = update.steps[UP]
    elements = SHAPE[0] * SHAPE[1]
    message = encode_step(UP, step)
    # per chunk: 48 int8 levels, 48 positions of 12 bits, one float32 scale
    assert len(message.coefficients.positions) == -(-len(step.levels) * 48 * 12 // 8)
    assert message.ByteSize() < 0.2 * elements  # 9 chunks, mostly partial: 1/5 B/element
    exact, _ = _update(topk=0)
    assert exact.steps[UP].values.dtype == torch.int8  # sign: one byte per element
    assert encode_step(UP, exact.steps[UP]).ByteSize() > elements
    assert _update(rule="sgd", topk=0)[0].steps[UP].values.dtype == torch.float32


def test_steps_survive_the_wire_and_the_log(tmp_path):
    update, _ = _update()
    exact, _ = _update(topk=0)
    log = UpdateLog(tmp_path / "updates")
    for sent in (update, dataclasses.replace(exact, round=4)):
        log.append(sent)
        read = log.read(sent.round)
        (wired,) = read_updates([pb.UpdateMessage.FromString(m.SerializeToString())
                                 for m in update_messages([sent])], tier=0)
        assert (read.update, read.hashes) == (sent.update, sent.hashes)
        assert wired.update.rule == "sign" and wired.hashes == {0: "ab" * 32}
        for got in (read, wired):
            assert got.steps.keys() == sent.steps.keys()
            for name, step in sent.steps.items():
                for field in dataclasses.fields(step):
                    left, right = getattr(got.steps[name], field.name), getattr(step, field.name)
                    if isinstance(left, torch.Tensor):
                        assert left.dtype == right.dtype and torch.equal(left, right)
                    else:
                        assert left == right, field.name
    stored = (tmp_path / "updates" / "round-3.safetensors").stat().st_size
    assert stored < 0.35 * SHAPE[0] * SHAPE[1]  # compact: not one byte per element


def _malformed(change):
    update, _ = _update()
    message = encode_step(UP, update.steps[UP])
    change(message)
    return message


@pytest.mark.parametrize("change, match", [
    (lambda m: m.coefficients.levels.CopyFrom(pb.Tensor(dtype="int8", shape=[1, 1],
                                                         data=b"\x80")), "one row per chunk"),
    (lambda m: setattr(m.coefficients, "positions", m.coefficients.positions[:-1]),
     "positions"),
    (lambda m: m.covered[0].range[0].__setattr__("stop", 500), "outside shape"),
    (lambda m: m.box[0].__setattr__("stop", 100), "bounding box"),
    (lambda m: m.coefficients.scales.CopyFrom(pb.Tensor(dtype="float32", shape=[9],
                                                         data=b"\xff" * 36)), "scales"),
    (lambda m: m.ClearField("coefficients"), "neither values nor coefficients"),
])
def test_malformed_steps_are_refused(change, match):
    with pytest.raises(MalformedStream, match=match):
        decode_step(_malformed(change))


def test_repeated_positions_and_bad_levels_are_refused():
    update, _ = _update()
    step = update.steps[UP]
    repeated = step.positions.clone()
    repeated[0, 1] = repeated[0, 0]
    for bad, match in ((dataclasses.replace(step, positions=repeated), "distinct"),
                       (dataclasses.replace(step, levels=torch.full_like(step.levels, -128)),
                        r"\[-127, 127\]")):
        with pytest.raises(MalformedStream, match=match):
            decode_step(encode_step(UP, bad))
    signs, _ = _update(topk=0)
    forged = encode_step(UP, signs.steps[UP])
    forged.values.data = bytes([2]) + forged.values.data[1:]
    with pytest.raises(MalformedStream, match="-1, 0 or 1"):
        decode_step(forged)


def _one_per_message(updates):
    """The stream as coordinators sent it before batches: one parameter per message."""
    for update in updates:
        yield next(iter(update_messages([update])))  # its header
        for name, step in update.steps.items():
            yield pb.UpdateMessage(parameter=encode_step(name, step))


def test_parameters_travel_in_batches_and_read_as_one_per_message_did():
    update, _ = _update()
    rounds = [update, dataclasses.replace(update, round=4)]
    batched = list(update_messages(rounds))
    assert [m.WhichOneof("item") for m in batched] == ["header", "parameters"] * 2
    assert len(batched[1].parameters.parameters) == 2
    for stream in (batched, list(_one_per_message(rounds))):
        read = list(read_updates([pb.UpdateMessage.FromString(m.SerializeToString())
                                  for m in stream]))
        assert [u.round for u in read] == [3, 4]
        for got in read:
            assert got.steps.keys() == update.steps.keys()
            for name, step in update.steps.items():
                assert torch.equal(got.steps[name].direction(step.box),
                                   step.direction(step.box))
    # a batch may not carry more parameters than its header announces
    header = pb.UpdateMessage()
    header.CopyFrom(batched[0])
    header.header.parameters = 1
    with pytest.raises(MalformedStream, match="announces 1 parameters but carries 2"):
        list(read_updates([header, batched[1]]))
    # nor a parameter twice, within a batch or across two
    twice = pb.UpdateMessage()
    twice.CopyFrom(batched[1])
    twice.parameters.parameters.append(batched[1].parameters.parameters[0])
    header.header.parameters = 3
    with pytest.raises(MalformedStream, match="twice"):
        list(read_updates([header, twice]))


def test_only_rounds_with_dense_steps_are_worth_gzip():
    dense, _ = _update(topk=0)  # the sign rule's int8 signs: gzip shrinks them about 5x
    compressed, _ = _update(topk=48)
    assert all(isinstance(step, CoefficientStep) for step in compressed.steps.values())
    assert carries_values(list(update_messages([dense])))
    assert carries_values(list(_one_per_message([dense])))
    assert not carries_values(list(update_messages([compressed])))
    assert not carries_values(list(update_messages([compressed]))[:1])  # a header alone


def test_update_streams_cut_short_or_out_of_order_are_refused():
    update, _ = _update()
    messages = list(_one_per_message([update, dataclasses.replace(update, round=4)]))
    cases = {
        "moved on after 1": messages[:2] + messages[3:],  # round 3 loses a parameter
        "announced 2 parameter updates": messages[:2],  # the stream ends mid-round
        "before its round's header": messages[1:],
        "arrives after round 3": messages[:3] + messages[:3],
        "updates 'model.layers.0.mlp.up_proj.weight' twice": messages[:2] + messages[1:2],
    }
    for match, stream in cases.items():
        with pytest.raises(MalformedStream, match=match):
            list(read_updates(stream))
    header = pb.UpdateMessage(header=pb.RoundUpdateHeader(round=1, learning_rate=0.1,
                                                          rule="adam"))
    with pytest.raises(MalformedStream, match="names update rule 'adam'"):
        list(read_updates([header]))


def test_bit_packing_round_trips_and_checks_its_size():
    values = torch.randint(0, 4096, (1001,))
    packed = pack_bits(values, 12)
    assert len(packed) == 1502 and torch.equal(unpack_bits(packed, 12, 1001), values)
    with pytest.raises(ValueError, match="take 1502 bytes"):
        unpack_bits(packed[:-1], 12, 1001)


def test_a_chunk_too_large_to_decode_exactly_is_refused():
    Broadcast(topk=48, chunk=64).check((4096, 4096))
    with pytest.raises(CompressionConfigError, match="too large for the exact broadcast"):
        Broadcast(topk=48, chunk=64).check((64, 64, 64, 64))
