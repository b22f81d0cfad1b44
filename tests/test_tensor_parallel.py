"""Tensor parallelism on CPU with Gloo: 2 spawned ranks compute what one process computes.

One spawn for the whole file (each costs seconds): the ranks run every check that needs
them and save what they saw; the tests compare it with one process's model here.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.models import logits, tiny_config

from matformer.modeling import AutoregressiveModel, layer_widths
from matformer.modeling.checkpoint.neuron_order import permute_neurons
from matformer.modeling.errors import NotParallelizable, UnevenSplit
from matformer.modeling.tensor_parallel import (
    balanced_order,
    canonical_order,
    check_parallelizable,
)

RANKS = 2
TIERS = (0, 1, 2)
GATE = "model.layers.0.mlp.gate_proj.weight"
DOWN = "model.layers.1.mlp.down_proj.weight"


def reference(**overrides) -> AutoregressiveModel:
    """The model every rank and this process build alike."""
    torch.manual_seed(0)
    return AutoregressiveModel(tiny_config(**overrides))


def batch() -> torch.Tensor:
    return torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(1))


def canonical_gradients(model, tier: int) -> dict[str, torch.Tensor]:
    """One process's gradient of the batch's loss at ``tier``."""
    model.zero_grad()
    model.loss(batch(), tier=tier).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def on_ranks(mesh) -> dict:
    """What one rank sees; every collective runs on every rank in the same order."""
    from torch.distributed.fsdp import fully_shard

    from matformer.modeling.tensor_parallel import gather_canonical, parallelize

    model = parallelize(reference(), mesh)
    seen = {"state": gather_canonical(model),
            "logits": {tier: logits(model, tier) for tier in TIERS},
            "local_gate": model.model.layers[0].mlp.gate_proj.weight.to_local().clone(),
            "grads": {}}
    for tier in (0, 1):
        model.zero_grad()
        model.loss(batch(), tier=tier).backward()
        seen["grads"][tier] = gather_canonical(
            model, {name: p.grad for name, p in model.named_parameters()})
    seen["local_gate_grad"] = model.model.layers[0].mlp.gate_proj.weight.grad.to_local()
    with pytest.raises(UnevenSplit) as uneven:  # tier 6: one neuron, two ranks
        logits(model, 6)
    seen["uneven"] = str(uneven.value)
    sharded = reference()
    fully_shard(sharded, mesh=mesh)
    with pytest.raises(NotParallelizable) as refused:
        parallelize(sharded, mesh)
    seen["fsdp"] = str(refused.value)
    return seen


def rank_main(rank: int, store: str, out: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=RANKS, timeout=timedelta(seconds=120))
    try:
        torch.save(on_ranks(init_device_mesh("cpu", (RANKS,))), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """What each of the 2 ranks saw."""
    folder = tmp_path_factory.mktemp("tp")
    # spawn, not fork: a fork of this process would copy whatever threads the tests before
    # it left running (servers, the intra-op pool) and could deadlock
    mp.spawn(rank_main, args=(str(folder / "store"), str(folder / "seen")), nprocs=RANKS)
    return [torch.load(folder / f"seen.{rank}") for rank in range(RANKS)]


def test_tier_0_logits_equal_one_process(ranks):
    single = logits(reference(), 0)
    for seen in ranks:
        torch.testing.assert_close(seen["logits"][0], single)


def test_deeper_tiers_use_the_balanced_layout_and_equal_canonical_tiers(ranks):
    """Rank r's shard holds canonical neurons r, r+R, ...: each rank's prefix is its share
    of the canonical prefix, and tier t is canonical tier t. Had the canonical weights been
    cut in contiguous blocks instead, tier t would be the prefix of each block: the model
    ``naive`` at tier t, whose logits differ."""
    model = reference()
    state = model.state_dict()
    naive = reference()
    orders = [canonical_order(width, RANKS) for width in layer_widths(model.config)]
    naive.load_state_dict(permute_neurons(dict(state), orders))
    for rank, seen in enumerate(ranks):
        assert torch.equal(seen["local_gate"], state[GATE][rank::RANKS])
        for tier in TIERS[1:]:
            torch.testing.assert_close(seen["logits"][tier], logits(model, tier))
            assert not torch.allclose(seen["logits"][tier], logits(naive, tier), atol=1e-4)


def test_gathered_weights_are_the_canonical_state_bit_for_bit(ranks):
    state = reference().state_dict()
    for seen in ranks:
        assert seen["state"].keys() == state.keys()
        for name, tensor in state.items():
            assert torch.equal(seen["state"][name], tensor), name


@pytest.mark.parametrize("tier", [0, 1])
def test_gathered_gradients_equal_one_process(ranks, tier):
    single = canonical_gradients(reference(), tier)
    for seen in ranks:
        grads = seen["grads"][tier]
        assert grads.keys() == single.keys()
        for name, grad in single.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-7, rtol=1e-5, msg=name)
    if tier == 1:  # the canonical tail, and every rank's own tail, got exactly zero
        grads = ranks[0]["grads"][1]
        assert not grads[GATE][32:].any() and not grads[DOWN][:, 32:].any()
        assert grads[GATE][:32].any()
        for seen in ranks:
            local = seen["local_gate_grad"]  # (32, C): this rank's 32 of the 64 neurons
            assert local[:16].any() and not local[16:].any()


def test_a_tier_that_does_not_split_and_fsdp2_are_refused_on_the_ranks(ranks):
    assert "does not split over 2 ranks" in ranks[0]["uneven"]
    assert "without --fsdp" in ranks[0]["fsdp"]


def test_what_does_not_split_is_refused_before_anything_is_split():
    with pytest.raises(UnevenSplit, match="heads"):
        check_parallelizable(reference(), 4)  # 2 key/value heads over 4 ranks
    with pytest.raises(UnevenSplit, match="layer 1's FFN holds 1 neurons"):
        check_parallelizable(reference(matformer_layer_tiers=[0, 6]), 2)
    alibi = reference(default_layer={"positional_encoding": "alibi"})
    with pytest.raises(NotParallelizable, match="alibi positions"):
        check_parallelizable(alibi, 2)
    wersa = reference(default_layer={"attn_impl": "wersa"})
    with pytest.raises(NotParallelizable, match="weights shared by every head"):
        check_parallelizable(wersa, 2)
    check_parallelizable(reference(), 2)


@pytest.mark.parametrize("width", [16, 64])
def test_balanced_order_puts_every_tier_prefix_evenly_on_the_ranks(width):
    order = balanced_order(width, 4)
    assert torch.equal(order[canonical_order(width, 4)], torch.arange(width))
    shards = order.view(4, -1)
    for tier_width in range(4, width + 1, 4):  # any multiple of the rank count
        local = tier_width // 4
        assert sorted(shards[:, :local].flatten().tolist()) == list(range(tier_width))
