"""One member's influence on a run is bounded by default (issue 30, rows 5, 13 and 15): a
member sending values 10^3 or 10^8 times an honest one's neither wrecks the master nor gets
the honest members excluded; a refused member does not hold the round up; a claimed speed
wins no more than a typical share until measured; run.toml values that would stall or wreck
a run are refused by name."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest
import torch
from support.helpers import Clock, checked_tables, run_config, run_tables, write_run_toml
from support.rounds import caps, events, results

from matformer.client.federated import FederatedClient, FederatedOptions
from matformer.modeling.compression import SparseResult
from matformer.modeling.mdat import build_default_mdat
from matformer.server.config import RunConfig
from matformer.server.coordinator import Coordinator
from matformer.server.errors import InvalidValue, NormTooLarge
from matformer.server.main import RunningServer

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "trust-influence-token"


def scaled(results: list[SparseResult], factor: float) -> list[SparseResult]:
    return [dataclasses.replace(r, values=(r.values.double() * factor).to(r.values.dtype))
            for r in results]


# -- row 5: a loud member in a default local-steps run, over gRPC ------------------------------


class Loud(FederatedClient):
    """Trains honestly and submits every value times ``factor`` (its own state stays honest)."""

    def __init__(self, options: FederatedOptions, factor: float) -> None:
        super().__init__(options, log=lambda line: None)
        honest = self.connection.submit
        self.connection.submit = lambda work, *, results, **rest: honest(
            work, results=scaled(results, factor), **rest)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "docs.mdat"
    build_default_mdat(path, limit=60).close()
    return path


def local_steps_run(folder: Path, corpus: Path, attack: float | None, *, rounds: int = 3,
                    tiers: tuple[int, ...] = (0, 1, 2), faults: dict | None = None) -> dict:
    """A default local-steps run (outer sgd, lr 1, DCT; [faults] as its defaults, or
    ``faults``) of members m0, m1, ... at ``tiers``, rounds of three at least, the first
    (tier 0) sending ``attack`` times its values. What the run did: the master's movement,
    the members' summaries, its exclusions, its round records and what /api/clients said the
    last time it showed a member's score."""
    tables = run_tables(
        corpus, run={"id": "trust", "dir": "run"}, tiers={"allowed": [0, 1, 2]},
        round={"min_clients": 3, "deadline_s": 120.0, "tokens_per_round": 512 * len(tiers),
               "rounds": rounds},
        update={"rule": "sgd", "lr": 1.0, "schedule": "constant"},
        compression={"encoding": "dct"}, inner={"batch_tokens": 256},
        checkpoint={"every_rounds": 100}, auth={"join_token": TOKEN}, faults=faults or {})
    server = RunningServer.start(RunConfig.load(write_run_toml(folder / "run.toml", tables)),
                                 grpc_port=0, http_port=0)
    coordinator = server.service.coordinator
    start = {n: t.clone() for n, t in coordinator.master.items()}
    summaries: dict[int, object] = {}
    try:
        def play(index: int) -> None:
            options = FederatedOptions(
                server=f"127.0.0.1:{server.grpc_port}", tier=tiers[index], name=f"m{index}",
                join_token=TOKEN, state_dir=folder / "clients" / str(index),
                microbatch_tokens=256, progress=False)
            member = (Loud(options, attack) if index == 0 and attack is not None
                      else FederatedClient(options, log=lambda line: None))
            try:
                summaries[index] = member.run()
            except Exception as err:  # an excluded member's client raises Excluded
                summaries[index] = err

        api = f"http://127.0.0.1:{server.http_port}/api/clients"
        scored: list[dict] = []  # /api/clients as last seen with a member's score in it
        done = threading.Event()

        def watch() -> None:
            while not done.wait(0.25):
                clients = json.loads(urllib.request.urlopen(api, timeout=30).read())
                if any(m["score"] is not None for m in clients["members"]):
                    scored[:] = [clients]

        threads = [threading.Thread(target=play, args=(index,), daemon=True)
                   for index in range(len(tiers))]
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        done.set()
        watcher.join(60)
        moved = torch.cat([(coordinator.master[n] - start[n]).flatten() for n in start])
        return {"moved": float(moved.norm()), "largest": max(
                    float(t.abs().max()) for t in coordinator.master.values()),
                "summaries": summaries, "round": coordinator.state.round, "rounds": rounds,
                "excluded": [e["detail"] for e in events(coordinator, "exclude")],
                "records": list(coordinator.state.rounds), "clients": scored[0] if scored
                else None}
    finally:
        server.stop()


@pytest.fixture(scope="module")
def honest_run(tmp_path_factory, corpus):
    return local_steps_run(tmp_path_factory.mktemp("honest"), corpus, None)


@pytest.mark.parametrize("attack", [1e3, 1e8])
def test_a_loud_member_neither_wrecks_the_master_nor_gets_anyone_excluded(tmp_path, corpus,
                                                                         honest_run, attack):
    """Without a default bound, the member at 1e3 moved the master hundreds of times further
    than an honest run does, and at 1e8 every member's next loss was NaN: the service refused
    it, each member trained again and was refused again, and all three were excluded after
    round 0."""
    run = local_steps_run(tmp_path, corpus, attack)
    assert run["excluded"] == []
    assert all(not isinstance(s, Exception) and s.finished for s in run["summaries"].values()), \
        run["summaries"]
    assert run["round"] == run["rounds"]
    # clipped to a multiple of its peers' magnitude, the loud member's own (honest) direction
    # weighs at most a few honest members': the master moves about as far as honestly
    assert run["moved"] <= 3 * honest_run["moved"], (run["moved"], honest_run["moved"])


def test_a_sign_flipped_member_at_an_honest_norm_is_excluded_by_its_scores(tmp_path, corpus):
    """Issue 47, item 3: m0 trains honestly and sends its results with the sign flipped
    (factor -1: an honest norm, which no norm bound sees). Every round scores it below 0 and
    the honest members above; once [faults] score_rounds of its rounds are scored it is
    excluded, and the three honest members finish the run."""
    run = local_steps_run(tmp_path, corpus, -1.0, rounds=6, tiers=(0, 1, 2, 1),
                          faults={"score_rounds": 3})
    scores = [{s["name"]: s["score"] for s in r["scores"]} for r in run["records"]]
    assert run["round"] == run["rounds"], run
    flipped = [r for r in scores if "m0" in r]
    assert len(flipped) == 3, scores  # excluded once three of its rounds were scored
    assert all(r.pop("m0") < 0 < min(r.values()) for r in flipped), scores
    (why,) = run["excluded"]
    assert why.startswith("its results pointed against its peers': mean agreement -")
    assert isinstance(run["summaries"][0], Exception)  # told it was excluded
    assert all(run["summaries"][i].finished for i in (1, 2, 3))
    # /api/clients the last time it showed a score: after the exclusion, as members left
    shown = {m["name"]: m for m in run["clients"]["members"]}
    assert shown and "m0" not in shown
    assert all(m["score_mean"] > 0 for m in shown.values()), shown


# -- rows 5 and 15: values far beyond an honest member's, in process ---------------------------


@pytest.mark.parametrize("members", [2, 3])
def test_values_near_the_absolute_limit_no_longer_move_the_master_to_their_scale(tmp_path,
                                                                                mdat_path,
                                                                                members):
    """Every value of the loud member is scaled to just below MAX_ABS_VALUE (1e9), which the
    absolute check lets through; with two members as with three, the lower median of the
    members' magnitudes is an honest one, and the loud result is scaled down to a multiple of
    it (sgd, lr 0.1: the master moved by about 1e7 before)."""
    c = Coordinator(run_config(tmp_path / "run", mdat_path, min_clients=members), clock=Clock())
    ids = [c.join(caps(f"m{i}"))[0].client_id for i in range(members)]
    for salt, cid in enumerate(ids[1:], start=1):
        c.submit(cid, 0, results(c, cid, salt=salt))
    loud = results(c, ids[0])
    peak = max(float(r.values.abs().max()) for r in loud)
    c.submit(ids[0], 0, scaled(loud, 9.9e8 / peak))
    assert c.state.round == 1 and events(c, "exclude") == []
    assert max(float(t.abs().max()) for t in c.master.values()) < 10.0


def test_a_lone_member_has_no_peers_to_be_clipped_against(tmp_path, mdat_path):
    """With one member there is nobody to compare with: its results go through as sent (one
    client's run equals plain SGD bit for bit, tests/test_federated.py)."""
    c = Coordinator(run_config(tmp_path / "run", mdat_path), clock=Clock())
    cid = c.join(caps("solo"))[0].client_id
    before = {n: t.clone() for n, t in c.master.items()}
    sent = scaled(results(c, cid), 1e3)
    c.submit(cid, 0, sent)
    by_name = {r.name: r for r in sent}
    for name, old in before.items():
        torch.testing.assert_close(old - c.master[name], 0.1 * by_name[name].values)


# -- row 5: max_norm refuses a loud member without holding the round up -----------------------


@pytest.mark.parametrize("refused_first", [True, False])
def test_a_refused_member_does_not_hold_the_round_until_its_deadline(tmp_path, mdat_path,
                                                                    refused_first):
    """Each refusal sends a member to train its whole share again; the round used to wait for
    those trainings (up to max_rejections of them, or the deadline). Now it closes as soon as
    everyone else is in, and the refused member's sequences go back to the queue."""
    config = run_config(tmp_path / "run", mdat_path, min_clients=3)
    config = dataclasses.replace(config, faults=dataclasses.replace(config.faults, max_norm=1e3))
    c = Coordinator(config, clock=Clock())
    loud, *honest = [c.join(caps(f"m{i}"))[0].client_id for i in range(3)]
    sequences = c.assignment_for(loud).sequence_ids

    def refuse_loud() -> None:
        with pytest.raises(NormTooLarge) as refused:
            c.submit(loud, 0, scaled(results(c, loud), 1e3))
        assert c.rejected(loud, refused.value) == " (refusal 1 of 3)"

    if refused_first:
        refuse_loud()
        assert c.state.round == 0  # the others are not in yet
    for salt, cid in enumerate(honest, start=1):
        c.submit(cid, 0, results(c, cid, salt=salt))
    if not refused_first:
        assert c.state.round == 0
        refuse_loud()
    assert c.state.round == 1  # the clock never moved: no deadline passed
    assert loud in c.membership.members  # refused once, not excluded
    assert any(e["client_id"] == loud and "refused" in e["detail"] for e in events(c, "drop"))
    handed_out = {i for a in c.current_round.assignments.values() for i in a.sequence_ids}
    assert set(sequences) <= handed_out  # requeued: round 1 takes them first


def test_a_member_refused_alone_may_still_deliver_its_round(tmp_path, mdat_path):
    config = run_config(tmp_path / "run", mdat_path)
    config = dataclasses.replace(config, faults=dataclasses.replace(config.faults, max_norm=1e3))
    c = Coordinator(config, clock=Clock())
    cid = c.join(caps("solo"))[0].client_id
    with pytest.raises(NormTooLarge) as refused:
        c.submit(cid, 0, scaled(results(c, cid), 1e3))
    c.rejected(cid, refused.value)
    assert c.current_round.index == 0 and cid in c.current_round.assignments
    c.submit(cid, 0, results(c, cid))
    assert c.state.round == 1


# -- row 13: a claimed speed wins no more than a typical share, also with two members ----------


def shares(c: Coordinator) -> dict[str, int]:
    return {cid: len(a.sequence_ids) for cid, a in c.current_round.assignments.items()}


def test_two_new_members_one_claiming_1e9_tokens_per_second_split_the_round_evenly(
        tmp_path, mdat_path):
    """The median of two speeds is their mean, so a claim of 1e9 used to make the typical
    speed 5e8 and win the claimer all 22 sequences of the first round."""
    c = Coordinator(run_config(tmp_path / "run", mdat_path, min_clients=2), clock=Clock())
    honest = c.join(caps("honest", tps=1000.0))[0].client_id
    liar = c.join(caps("liar", tps=1e9))[0].client_id
    split = shares(c)
    assert abs(split[liar] - split[honest]) <= 1, split


def test_a_claim_of_1e9_beside_a_measured_member_wins_no_more_than_its_share(tmp_path,
                                                                            mdat_path):
    clock = Clock()
    c = Coordinator(run_config(tmp_path / "run", mdat_path, min_clients=2), clock=clock)
    measured, leaving = [c.join(caps(name))[0].client_id for name in ("measured", "leaving")]
    for salt, cid in enumerate((measured, leaving)):
        c.submit(cid, 0, results(c, cid, salt=salt), train_seconds=1.0)
    assert c.membership.get(measured).measured_by_round
    c.leave(leaving)  # round 1 goes on with the measured member alone
    c.submit(measured, 1, results(c, measured), train_seconds=1.0)
    liar = c.join(caps("liar", tps=1e9))[0].client_id  # opens round 2
    split = shares(c)
    assert c.current_round.index == 2 and set(split) == {measured, liar}
    assert split[liar] <= sum(split.values()) / 2 + 1, split


# -- row 15: run.toml values that would stall or wreck a run ------------------------------------


@pytest.mark.parametrize(("section", "keys", "message"), [
    ("compression", {"lr": 1e308},
     r"^\[compression\] lr must lie in \(0, 10\.0\], got 1e\+308\.$"),
    ("compression", {"topk": 100_000},
     r"^\[compression\] topk must lie in \[1, 4096\] \(chunk 64²\), got 100000\.$"),
    ("compression", {"chunk": 8, "topk": 65},
     r"^\[compression\] topk must lie in \[1, 64\] \(chunk 8²\), got 65\.$"),
    ("round", {"deadline_s": 1e-300},
     r"^\[round\] deadline_s must lie in \[1\.0, 2592000\.0\] seconds, got 1e-300\.$"),
    ("faults", {"heartbeat_s": 1e-300},
     r"^\[faults\] heartbeat_s must lie in \[0\.1, 2592000\.0\] seconds, got 1e-300\.$"),
])
def test_values_that_would_stall_or_wreck_a_run_are_refused_by_name(section, keys, message):
    tables = checked_tables()
    tables[section] = {**tables.get(section, {}), **keys}
    with pytest.raises(InvalidValue, match=message):
        RunConfig.from_dict(tables)


def test_the_edges_of_those_ranges_are_accepted():
    config = RunConfig.from_dict(checked_tables(
        compression={"lr": 10.0, "topk": 4096}, round={"rounds": 1, "deadline_s": 1.0},
        faults={"heartbeat_s": 0.1, "heartbeat_timeout_s": 0.2}))
    assert config.compression.topk == 4096 and config.faults.heartbeat_s == 0.1
    dense = RunConfig.from_dict(checked_tables(compression={"encoding": "dense", "topk": 10**6}))
    assert dense.compression.topk == 10**6  # dense sends every value: topk is not read


# -- the benchmark that measures all of this, at a tiny size -----------------------------------


def test_the_quality_benchmark_runs_with_an_attacking_member(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "federated_quality.py"), "--runs", "L",
         "--rounds", "2", "--local-rounds", "2", "--tokens-per-round", "2048",
         "--warmup-rounds", "0", "--documents", "80", "--attack-scale", "1000",
         "--out", str(tmp_path / "out")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "run L done" in done.stdout
