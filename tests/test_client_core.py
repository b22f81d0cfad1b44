"""The client's core without gRPC: local rounds, the replica, and the backbone equivalence
(dense, β = 0, sgd: federated with one client is standalone SGD, bit for bit)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from support.models import tiny_config

from matformer.client.errors import FeedbackStateMismatch, ModelMismatch
from matformer.client.local_round import LocalRound, LocalSteps
from matformer.client.replica import Replica
from matformer.modeling import AutoregressiveModel
from matformer.modeling.batching import AdaptiveLimitsConfig, MicrobatchRunner
from matformer.modeling.checkpoint.export import export_tiers
from matformer.modeling.checkpoint.loader import load_for_tier
from matformer.modeling.checkpoint.pretrained import save_pretrained
from matformer.modeling.checkpoint.slicing import slice_state
from matformer.modeling.compression import (
    CompressionConfig,
    RoundUpdate,
    UpdateConfig,
    region_slices,
    tier_regions,
    universal_shapes,
    weight_hash,
)
from matformer.modeling.matformer import layer_widths, tier_label
from matformer.modeling.naming import canonical_state_dict, load_canonical_state_dict
from matformer.modeling.optim import OptimizerConfig
from matformer.modeling.training import TierSchedule, train_step_on_examples
from matformer.server.update_steps import Carried, close_round

LR = 0.1
DENSE = CompressionConfig(encoding="dense", decay=0.0, lr=1.0)
SGD = UpdateConfig(rule="sgd", lr=LR)
STEPS = LocalSteps(optimizer=OptimizerConfig(name="adamw", lr=1e-2, schedule="constant"),
                   batch_tokens=24)


def _limits():
    return AdaptiveLimitsConfig(max_tokens=48, max_examples=2).build()  # several microbatches


def _sequences(seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 95, (n,), generator=generator) for n in (17, 9, 24, 5, 12)]


def _sliced(universal: AutoregressiveModel, tier: int) -> AutoregressiveModel:
    """The tier slice of ``universal`` as a model of its own (what load_for_tier gives)."""
    config = universal.config
    widths = layer_widths(config, tier)
    sliced = AutoregressiveModel(dataclasses.replace(
        config, intermediate_size=widths[0], matformer_tier=tier,
        matformer_base_intermediate_size=config.matformer_base_intermediate_size,
    ))
    state = slice_state(canonical_state_dict(universal), widths)
    load_canonical_state_dict(sliced, {k: v.clone() for k, v in state.items()})
    return sliced


def _standalone_sgd(model, schedule, rounds):
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    runner = MicrobatchRunner(model, _limits())
    for step, sequences in enumerate(rounds):
        train_step_on_examples(runner, optimizer, sequences, schedule, step)
    return canonical_state_dict(model)


def _federated(replica, schedule, rounds, master=None):
    """One client: local round → aggregate → apply to the replica (and the master)."""
    local = LocalRound(replica, DENSE.build(), schedule, _limits())
    for step, sequences in enumerate(rounds):
        update, _ = _update(SGD, local.run(sequences, step).results)
        replica.apply(update)
        if master is not None:
            master.update(update.apply(master))
    return canonical_state_dict(replica.model)


def _update(config, results, residual=None):
    """The round update the coordinator's close makes of ``results`` (and its broadcast
    residual); the master it closes on does not matter here."""
    by_name = {}
    for result in results:
        by_name.setdefault(result.name, []).append(result)
    scratch = {name: torch.zeros(rs[0].shape) for name, rs in by_name.items()}
    _, steps, carried = close_round(config.build(), scratch, by_name,
                                   Carried(residual=residual or {}))
    return RoundUpdate(round=0, update=config, steps=steps, hashes={}), carried.residual


def _assert_equal(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("schedule", [TierSchedule(tiers=[0]),
                                      TierSchedule(tiers=[0, 1], weights=[1.0, 0.5])])
def test_one_client_dense_sgd_is_standalone_sgd_bit_for_bit(schedule):
    universal = AutoregressiveModel(tiny_config())
    rounds = [_sequences(1), _sequences(2)]
    expected = _standalone_sgd(copy.deepcopy(universal), schedule, rounds)
    master = {k: v.clone() for k, v in canonical_state_dict(universal).items()}
    got = _federated(Replica(copy.deepcopy(universal)), schedule, rounds, master)
    _assert_equal(got, expected)
    _assert_equal(master, expected)
    assert not torch.equal(expected["model.norm.weight"], universal.model.norm.weight)


def test_tier1_client_changes_only_its_slice_of_the_master():
    universal = AutoregressiveModel(tiny_config())
    before = {k: v.clone() for k, v in canonical_state_dict(universal).items()}
    rounds = [_sequences(3), _sequences(4)]
    expected = _standalone_sgd(_sliced(universal, 1), TierSchedule(tiers=[1]), rounds)
    master = {k: v.clone() for k, v in before.items()}
    got = _federated(Replica(_sliced(universal, 1)), TierSchedule(tiers=[1]), rounds, master)
    _assert_equal(got, expected)
    regions = tier_regions(universal_shapes(universal.config), universal.config, 1)
    tail = master["model.layers.0.mlp.up_proj.weight"][32:]
    assert torch.equal(tail, before["model.layers.0.mlp.up_proj.weight"][32:])
    for name, tensor in master.items():
        where = region_slices(regions[name])
        assert torch.equal(tensor[where], expected[name]), name
        outside = tensor.clone()
        outside[where] = before[name][where]
        assert torch.equal(outside, before[name]), name  # nothing outside the slice moved


def test_universal_replica_training_tier1_claims_only_the_tier1_region():
    universal = AutoregressiveModel(tiny_config())
    local = LocalRound(Replica(universal), DENSE.build(), TierSchedule(tiers=[1]), _limits())
    results = {r.name: r for r in local.run(_sequences()).results}
    down = results["model.layers.1.mlp.down_proj.weight"]
    assert down.shape == (32, 64) and down.region == ((0, 32), (0, 32))


def test_hash_matches_master_after_the_same_update_and_detects_drift():
    universal = AutoregressiveModel(tiny_config())
    config = universal.config
    master = {k: v.clone() for k, v in canonical_state_dict(universal).items()}
    replica = Replica(_sliced(universal, 1))
    _federated(replica, TierSchedule(tiers=[1]), [_sequences()], master)
    published = weight_hash(master, tier_regions(universal_shapes(config), config, 1))
    assert replica.hash(1) == published
    assert replica.hash(1) != weight_hash(master)  # tier 0's hash differs
    with torch.no_grad():
        replica.parameters["model.norm.weight"][3] += 1e-6
    assert replica.hash(1) != published


@pytest.mark.parametrize("broadcast_topk", [0, 20])
def test_heterogeneous_compressed_round_keeps_every_replica_equal_to_the_master(broadcast_topk):
    """Tiers 0, 1 and 2 train, the coordinator aggregates and broadcasts (exact, or top-k
    coefficients with its residual carried over), and every replica's hash is the master's
    at its tier every round."""
    universal = AutoregressiveModel(tiny_config())
    config = universal.config
    shapes = universal_shapes(config)
    compressor = CompressionConfig(encoding="dct", chunk=16, topk=8).build()
    rule = UpdateConfig(rule="sign", lr=1e-3, broadcast_topk=broadcast_topk, chunk=16)
    master = {k: v.clone() for k, v in canonical_state_dict(universal).items()}
    replicas = {tier: Replica(_sliced(universal, tier)) for tier in (0, 1, 2)}
    rounds = {tier: LocalRound(r, compressor, TierSchedule(tiers=[tier]), _limits())
              for tier, r in replicas.items()}
    residual = {}
    for step in range(3):
        results = [w for t, local in rounds.items() for w in local.run(_sequences(t + 10 * step),
                                                                        step).results]
        update, residual = _update(rule, results, residual)
        master.update(update.apply(master))
        for tier, replica in replicas.items():
            regions = tier_regions(shapes, config, tier)
            replica.apply(update.cut(tier, regions))
            assert replica.hash(tier) == weight_hash(master, regions), (step, tier)
    assert bool(residual) == bool(broadcast_topk)


def test_error_feedback_survives_a_restart(tmp_path):
    universal = AutoregressiveModel(tiny_config())
    compressor = CompressionConfig(encoding="dct", chunk=16, topk=4, decay=0.9).build()
    schedule = TierSchedule(tiers=[1])
    first = LocalRound(Replica(_sliced(universal, 1)), compressor, schedule, _limits())
    first.run(_sequences(1))
    first.feedback.save(tmp_path / "feedback.safetensors")
    restarted = LocalRound(Replica(_sliced(universal, 1)), compressor, schedule, _limits())
    restarted.feedback.load(tmp_path / "feedback.safetensors")
    for a, b in zip(first.run(_sequences(2), 1).results, restarted.run(_sequences(2), 1).results,
                    strict=True):
        assert a.name == b.name and torch.equal(a.values, b.values)
        assert torch.equal(a.indices, b.indices) and torch.equal(a.chunks, b.chunks)
    other_tier = LocalRound(Replica(universal), compressor, TierSchedule(tiers=[0]), _limits())
    with pytest.raises(FeedbackStateMismatch, match="another tier"):
        other_tier.feedback.load(tmp_path / "feedback.safetensors")


@pytest.mark.parametrize("clip", [0.0, 0.05])
def test_each_inner_step_takes_the_gradient_clipped_to_its_norm(clip):
    """[inner] grad_clip: the optimizer steps on a gradient of norm at most the clip, as
    standalone training's; 0 leaves it whole (this model's first gradients are far above
    0.05)."""
    steps = dataclasses.replace(STEPS, grad_clip=clip)
    local = LocalRound(Replica(AutoregressiveModel(tiny_config())), DENSE.build(),
                       TierSchedule(tiers=[0]), _limits(), steps=steps)
    norms = []
    take_step = local.optimizer.step

    def step():
        grads = [p.grad for p in local.replica.model.parameters() if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads]))))
        take_step()

    local.optimizer.step = step
    local.run(_sequences(1))
    assert len(norms) >= 2
    if clip:
        assert max(norms) <= clip * (1 + 1e-5)
    else:
        assert min(norms) > 0.05


def test_local_steps_keep_the_replica_and_save_the_inner_optimizer_with_the_feedback(tmp_path):
    """Local steps leave the replica's weights where they were, and their result is the
    weights' change; the inner optimizer's state is saved with the error feedback, and a
    state saved without local steps is refused by a client that takes them."""
    universal = AutoregressiveModel(tiny_config())
    steps = LocalSteps(optimizer=OptimizerConfig(name="adamw", lr=1e-2, schedule="constant"),
                       batch_tokens=64)

    def local_round(steps):
        return LocalRound(Replica(_sliced(universal, 1)), DENSE.build(),
                          TierSchedule(tiers=[1]), _limits(), steps=steps)

    first = local_round(steps)
    before = {n: p.detach().clone() for n, p in first.replica.parameters.items()}
    work = first.run(_sequences(1))
    assert all(torch.equal(before[n], p) for n, p in first.replica.parameters.items())
    moved = {r.name: r.values for r in work.results}
    assert any(bool(v.abs().sum() > 0) for v in moved.values())
    first.save(tmp_path / "state.safetensors")

    restarted = local_round(steps)
    restarted.restore(tmp_path / "state.safetensors")
    saved, loaded = first.optimizer.state_dict(), restarted.optimizer.state_dict()
    for a, b in zip(saved["optimizers"], loaded["optimizers"], strict=True):
        for index, moments in a["state"].items():
            assert all(torch.equal(t, b["state"][index][k]) for k, t in moments.items())
    for a, b in zip(first.run(_sequences(2), 1).results, restarted.run(_sequences(2), 1).results,
                    strict=True):
        assert torch.equal(a.values, b.values)  # the same state, the same next round

    nested = LocalRound(Replica(_sliced(universal, 1)), DENSE.build(),
                        TierSchedule(tiers=[1, 2]), _limits(), steps=steps)  # --also-train 2
    work = nested.run(_sequences(1))
    assert set(work.losses) == {tier_label(1), tier_label(2)}
    assert all(torch.isfinite(r.values).all() for r in work.results)

    gradient_only = local_round(None)
    gradient_only.run(_sequences(1))
    gradient_only.save(tmp_path / "plain.safetensors")
    with pytest.raises(FeedbackStateMismatch, match="without local steps"):
        local_round(steps).restore(tmp_path / "plain.safetensors")


def test_an_update_for_an_unknown_parameter_is_refused():
    replica = Replica(AutoregressiveModel(tiny_config()))
    result = DENSE.build().encode("model.extra.weight", torch.ones(2, 2), shape=(2, 2),
                                  region=((0, 2), (0, 2)), tokens=1)
    with pytest.raises(ModelMismatch, match=r"model\.extra\.weight"):
        replica.apply(_update(SGD, [result])[0])


@pytest.mark.parametrize("strategy", ["sliced", "universal"])
def test_replica_from_load_for_tier_with_tied_embeddings_is_standalone_sgd(tmp_path, strategy):
    universal = AutoregressiveModel(tiny_config(tie_word_embeddings=True))
    save_pretrained(universal, tmp_path / "ckpt")
    export_tiers(tmp_path / "ckpt", [1])
    model, _ = load_for_tier(tmp_path / "ckpt", 1, strategy)
    replica = Replica(model)
    assert replica.aliases == {"lm_head.weight"}  # the tied tensor is updated once
    schedule = TierSchedule(tiers=[1])
    expected = _standalone_sgd(_sliced(universal, 1), schedule, [_sequences()])
    got = _federated(replica, schedule, [_sequences()])
    for name, tensor in expected.items():  # "universal" holds more; its tail must not move
        assert torch.equal(got[name][tuple(slice(0, n) for n in tensor.shape)], tensor), name
    if strategy == "universal":
        tail = got["model.layers.0.mlp.gate_proj.weight"][32:]
        initial = canonical_state_dict(universal)["model.layers.0.mlp.gate_proj.weight"]
        assert torch.equal(tail, initial[32:])


def test_an_update_applied_between_inner_steps_moves_the_training_with_it():
    """Overlapped rounds apply the update of the round before between two inner steps: the
    replica ends on the new weights, bit for bit, and the result is measured from them. One
    applied after the last step leaves the steps as they were (the same result, up to the
    rounding of the shift); one after the first makes the later steps train on the moved
    weights."""
    universal = AutoregressiveModel(tiny_config())
    shift = {name: torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.05
             for name, p in Replica(_sliced(universal, 1)).parameters.items()}

    def run(at: int | None) -> tuple[dict, dict, dict, int]:
        local = LocalRound(Replica(_sliced(universal, 1)), DENSE.build(),
                           TierSchedule(tiers=[1]), _limits(), steps=STEPS)
        calls, moved = [], {}

        def advance(exact):
            calls.append(len(calls))
            if len(calls) - 1 != at:
                return None
            moved.update({name: exact[name] + shift[name] for name in exact})
            return dict(moved)

        work = local.run(_sequences(1), advance=advance)
        final = {n: p.detach().clone() for n, p in local.replica.parameters.items()}
        return {r.name: r.values for r in work.results}, final, moved, len(calls)

    plain, start, _, count = run(None)
    assert count >= 3  # one call after each inner step
    assert all(torch.equal(start[n], p) for n, p in
               Replica(_sliced(universal, 1)).parameters.items())
    late, final, moved, _ = run(count - 1)
    assert all(torch.equal(final[n], moved[n]) for n in final)  # the replica holds the update
    assert all(torch.allclose(late[n], plain[n], atol=1e-6) for n in plain)
    early, final, moved, _ = run(0)
    assert all(torch.equal(final[n], moved[n]) for n in final)
    assert any(not torch.allclose(early[n], plain[n], atol=1e-4) for n in plain)


def test_eager_rounds_of_one_client_at_outer_lr_1_train_as_if_nothing_were_delayed():
    """Eager updates: an overlapped round starts from the replica plus the client's own
    last change, its estimate of the update it lacks. One client, dense results, outer SGD at
    lr 1: the estimate is the update, so round 1, trained before round 0's update arrives,
    gives what it gives after it (synchronous rounds), up to float rounding."""
    universal = AutoregressiveModel(tiny_config())

    def local_round():
        return LocalRound(Replica(_sliced(universal, 1)), DENSE.build(),
                          TierSchedule(tiers=[1]), _limits(), steps=STEPS)

    synchronous = local_round()
    first = synchronous.run(_sequences(1))
    with torch.no_grad():  # the coordinator's outer step at lr 1: W1 = W0 - Δ0
        for result in first.results:
            synchronous.replica.parameters[result.name].sub_(result.values)
    expected = {r.name: r.values for r in synchronous.run(_sequences(2), 1).results}

    overlapped = local_round()
    overlapped.run(_sequences(1), advance=lambda exact: None)  # round 0's update: not yet
    arrives = []

    def advance(exact):  # round 0's update, arriving after round 1's first inner step
        arrives.append(True)
        if len(arrives) != 1:
            return None
        return {r.name: exact[r.name] - r.values for r in first.results}

    got = {r.name: r.values for r in overlapped.run(_sequences(2), 1, advance=advance).results}
    assert all(torch.allclose(got[n], expected[n], atol=1e-5) for n in expected)
    # without the estimate (the lead dropped, as after a refused round) it is a round late
    overlapped.reset()
    assert overlapped.lead is None
