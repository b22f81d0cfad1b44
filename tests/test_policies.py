"""Round policies (server/policies/): each is one file and a registration line; the mean is
today's close bit for bit; the trimmed mean is scipy's, element by element; the outer AdamW
is torch's AdamW on the pseudo-gradients; each survives a restart bit for bit."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from support.helpers import Clock, run_tables
from support.rounds import caps, drive, same

from matformer.modeling.compression import SparseResult, UpdateConfig
from matformer.server.config import RunConfig
from matformer.server.coordinator import Coordinator
from matformer.server.errors import InvalidValue, UnknownKey
from matformer.server.policies import POLICIES, policy_from_record
from matformer.server.policies.mean import TokenMean
from matformer.server.policies.outer_adamw import AdamOptions, OuterAdamW
from matformer.server.policies.trimmed_mean import TrimmedMean, TrimOptions
from matformer.server.update_steps import Momentum, close_round

ROOT = Path(__file__).resolve().parents[1]
NAME = "w"
SHAPE = (8, 6)


def dense(values: torch.Tensor, rows: int = SHAPE[0], tokens: int = 100) -> SparseResult:
    """A dense result covering the first ``rows`` rows (a smaller tier's region)."""
    region = ((0, rows), (0, SHAPE[1]))
    return SparseResult(name=NAME, shape=SHAPE, region=region, encoding="dense", chunk=(),
                        chunks=torch.zeros(0, dtype=torch.int64),
                        indices=torch.zeros(0, dtype=torch.int64),
                        values=values[:rows].clone(), tokens=tokens)


SGD = UpdateConfig(rule="sgd", lr=0.1, broadcast_topk=0).build()


# -- the seam ----------------------------------------------------------------------------

def test_each_policy_is_one_file_and_one_registration_line():
    package = ROOT / "server" / "policies"
    registry = (package / "__init__.py").read_text()
    product = [p for d in ("server", "relay", "client", "modeling", "local_testnet", "scripts")
               for p in (ROOT / d).rglob("*.py") if package not in p.parents]
    for name, kind in POLICIES.items():
        home = package / f"{kind.__module__.rsplit('.', 1)[-1]}.py"
        assert home.is_file() and kind.__name__ in home.read_text()
        if name == "mean":  # the default: a record without a name is the mean's
            continue
        # registered once: its import and its entry in the tuple
        assert len(re.findall(rf"\b{kind.__name__}\b", registry)) == 2, name
        # and named nowhere else in the product: nothing but the registry knows it
        for path in product:
            text = path.read_text()
            assert kind.__name__ not in text and f'"{name}"' not in text, (name, path)


def test_a_policy_is_chosen_and_configured_in_run_toml(tmp_path, mdat_path):
    config = RunConfig.from_dict(run_tables(
        mdat_path, policy={"name": "trimmed_mean", "options": {"trim": 0.2}}))
    assert config.policy.options == TrimOptions(trim=0.2)
    assert RunConfig.from_dict(config.to_dict()) == config
    assert RunConfig.from_dict(run_tables(mdat_path)).policy.name == "mean"
    with pytest.raises(InvalidValue, match=r"\[policy\] name 'median' is not one of mean, "
                                            r"trimmed_mean, outer_adamw"):
        RunConfig.from_dict(run_tables(mdat_path, policy={"name": "median"}))
    with pytest.raises(UnknownKey, match=r"\[policy.options\] has no key 'trm'; did you mean "
                                         r"'trim'\?"):
        RunConfig.from_dict(run_tables(mdat_path, policy={"name": "trimmed_mean",
                                                          "options": {"trm": 0.2}}))
    with pytest.raises(InvalidValue, match=r"trim must lie in \[0, 0.5\), got 0.5"):
        RunConfig.from_dict(run_tables(mdat_path, policy={"name": "trimmed_mean",
                                                          "options": {"trim": 0.5}}))
    with pytest.raises(InvalidValue, match=r"outer_adamw.*needs rule = \"sgd\""):
        RunConfig.from_dict(run_tables(mdat_path, policy={"name": "outer_adamw"},
                                       update={"rule": "sign", "lr": 0.01}))


@pytest.mark.parametrize("policy", [
    TokenMean(votes=True), TokenMean(momentum=Momentum(0.9, nesterov=True)),
    TrimmedMean(TrimOptions(trim=0.1)), OuterAdamW(AdamOptions(beta2=0.99, eps=1e-6))],
    ids=["vote", "momentum", "trimmed", "adamw"])
def test_a_record_gives_back_the_policy_that_wrote_it(policy):
    again = policy_from_record(policy.record())
    assert type(again) is type(policy) and again.record() == policy.record()
    assert again.describe() == policy.describe()


def test_a_round_logged_before_policies_had_names_is_closed_by_the_mean():
    legacy = {"votes": False, "momentum": {"factor": 0.9, "nesterov": True}}
    policy = policy_from_record(legacy)
    assert isinstance(policy, TokenMean) and policy.momentum == Momentum(0.9, nesterov=True)


# -- the arithmetic ------------------------------------------------------------------------

def test_the_mean_policy_is_close_round():
    gen = torch.Generator().manual_seed(0)
    master = {NAME: torch.randn(SHAPE, generator=gen)}
    results = {NAME: [dense(torch.randn(SHAPE, generator=gen), rows=r) for r in (8, 4, 2)]}
    momentum = Momentum(0.9, nesterov=True)
    ours = TokenMean(momentum=momentum).close(SGD, master, results)
    theirs = close_round(SGD, master, results, momentum=momentum)
    assert same(ours[0], theirs[0]) and same(ours[2].momentum, theirs[2].momentum)


def test_the_trimmed_mean_is_scipys_element_by_element_and_a_loud_member_moves_nothing():
    gen = torch.Generator().manual_seed(1)
    honest = [torch.randn(SHAPE, generator=gen) for _ in range(4)]
    loud = honest[0] * 1000.0
    rows = (8, 8, 8, 4, 2)  # two smaller tiers: fewer results cover their rows' complement
    values = [*honest, loud]
    results = {NAME: [dense(v, rows=r) for v, r in zip(values, rows, strict=True)]}
    master = {NAME: torch.zeros(SHAPE)}
    new, _, _ = TrimmedMean(TrimOptions(trim=0.25)).close(SGD, master, results)
    expected = np.zeros(SHAPE, dtype=np.float32)
    for i in range(SHAPE[0]):
        covering = [v[i].numpy() for v, r in zip(values, rows, strict=True) if i < r]
        expected[i] = stats.trim_mean(np.stack(covering), 0.25, axis=0)
    torch.testing.assert_close(-new[NAME] / 0.1, torch.from_numpy(expected), rtol=1e-5,
                               atol=1e-6)
    # five results cover rows 0-1: one is set aside at each end, so the loud one never counts
    assert (new[NAME][:2].abs() <= 0.1 * torch.stack(honest)[:, :2].abs().amax(0) + 1e-6).all()


def test_outer_adamw_is_torchs_adamw_on_the_pseudo_gradients():
    gen = torch.Generator().manual_seed(2)
    start = torch.randn(SHAPE, generator=gen)
    grads = [torch.randn(SHAPE, generator=gen) for _ in range(5)]
    options = AdamOptions(beta1=0.9, beta2=0.95, eps=1e-8)
    rule = UpdateConfig(rule="sgd", lr=0.05, weight_decay=0.1, broadcast_topk=0).build()
    policy, master, carried = OuterAdamW(options), {NAME: start.clone()}, None
    for g in grads:
        master, _, carried = policy.close(rule, master, {NAME: [dense(g)]}, carried)
    reference = torch.nn.Parameter(start.clone())
    adamw = torch.optim.AdamW([reference], lr=0.05, betas=(0.9, 0.95), eps=1e-8,
                              weight_decay=0.1)
    for g in grads:
        reference.grad = g.clone()
        adamw.step()
    torch.testing.assert_close(master[NAME], reference.detach(), rtol=1e-5, atol=1e-6)
    state = adamw.state[reference]
    torch.testing.assert_close(carried.buffers["exp_avg"][NAME], state["exp_avg"])
    torch.testing.assert_close(carried.buffers["exp_avg_sq"][NAME], state["exp_avg_sq"])


def test_outer_adamw_leaves_an_uncovered_element_and_corrects_by_its_own_count():
    gen = torch.Generator().manual_seed(3)
    rule = UpdateConfig(rule="sgd", lr=0.05, broadcast_topk=0).build()
    policy, master, carried = OuterAdamW(AdamOptions()), {NAME: torch.zeros(SHAPE)}, None
    master, _, carried = policy.close(rule, master, {NAME: [dense(torch.ones(SHAPE), rows=2)]},
                                      carried)
    assert (master[NAME][2:] == 0).all()  # rows no result covered: not moved
    master, _, carried = policy.close(
        rule, master, {NAME: [dense(torch.randn(SHAPE, generator=gen))]}, carried)
    counts = carried.buffers["step"][NAME]
    assert (counts[:2] == 2).all() and (counts[2:] == 1).all()
    # a first step moves by lr (Adam's first step is lr · sign, up to ε)
    torch.testing.assert_close(master[NAME][2:].abs(), torch.full((6, 6), 0.05), rtol=1e-5,
                               atol=1e-6)


# -- a run under each new policy, interrupted and resumed ---------------------------------

ROUNDS = 5


def policy_config(run_dir: Path, mdat_path: Path, name: str) -> RunConfig:
    """A compressed broadcast (so the residual is carried too) and checkpoints every 2."""
    return RunConfig.from_dict(run_tables(
        mdat_path, run={"id": name, "dir": str(run_dir)},
        round={"min_clients": 1, "deadline_s": 10.0, "tokens_per_round": 1024, "rounds": 20},
        checkpoint={"every_rounds": 2}, policy={"name": name},
        update={"rule": "sgd", "lr": 0.01, "schedule": "constant", "broadcast_topk": 8},
        compression={"encoding": "dense", "chunk": 16}))


@pytest.mark.parametrize("name", ["trimmed_mean", "outer_adamw"])
def test_a_restarted_run_under_a_new_policy_ends_where_the_straight_one_does(
        tmp_path, mdat_path, name):
    clock = Clock()
    straight = Coordinator(policy_config(tmp_path / "straight", mdat_path, name), clock=clock)
    cid = straight.join(caps("a", tier=1))[0].client_id
    drive(straight, clock, cid, ROUNDS)
    assert straight.carried.residual
    if name == "outer_adamw":
        assert set(straight.carried.buffers) == {"exp_avg", "exp_avg_sq", "step"}

    config = policy_config(tmp_path / "run", mdat_path, name)
    first = Coordinator(config, clock=clock)
    first.join(caps("a", tier=1))
    drive(first, clock, cid, 3)  # checkpoint round-2, round 2 logged with its inputs
    del first
    resumed = Coordinator(config, clock=clock)
    assert resumed.state.round == 3 and resumed.state.checkpoints == [0, 2]
    resumed.advance()
    drive(resumed, clock, cid, ROUNDS - 3)
    assert same(resumed.master, straight.master)
    assert same(resumed.carried.residual, straight.carried.residual)
    for kind, tensors in straight.carried.buffers.items():
        assert same(resumed.carried.buffers[kind], tensors), kind
