"""Federated runs end to end: a real coordinator (gRPC + HTTP on loopback) and real
``FederatedClient``s in threads, exchanging compressed results and updates over the wire."""

from __future__ import annotations

import dataclasses
import math
import threading

import pytest
import torch
from support.helpers import run_tables, write_run_toml
from support.models import TAILS_STRATEGY, mdat_with_one_token_tails, tiny_config
from support.rounds import committed

from matformer.client.connection import PublishedCheckpoint
from matformer.client.errors import DataMismatch, ReplicaDiverged, RoundOver
from matformer.client.federated import FederatedClient, FederatedOptions
from matformer.client.replica import Replica
from matformer.local_testnet.held_out import HeldOut
from matformer.modeling.batching import (
    AdaptiveLimitsConfig,
    MicrobatchRunner,
    pack_rows,
    plan_packed,
)
from matformer.modeling.checkpoint import load_pretrained
from matformer.modeling.compression import region_slices
from matformer.modeling.mdat import DEFAULT_STRATEGY, build_default_mdat
from matformer.modeling.naming import canonical_state_dict
from matformer.modeling.optim import OptimizerConfig, lr_factor
from matformer.modeling.training import TierSchedule, train_step_on_examples
from matformer.server.config import RunConfig
from matformer.server.ledger import audit_run
from matformer.server.main import RunningServer

TOKEN = "federated-test-token"
SEQ_LEN = 128  # the runs' sequence length: the row length a client packs into
UP = "model.layers.0.mlp.up_proj.weight"
DOWN = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def mdat(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "docs.mdat"
    build_default_mdat(path, limit=60).close()
    return path


def start(tmp_path, mdat, *, min_clients=1, rounds=3, encoding="dct", rule="sign", lr=0.01,
          tokens_per_round=1024, deadline_s=30.0, every=100, tiers=(0, 1, 2),
          strategy=DEFAULT_STRATEGY["strategy_name"], max_seq_len=SEQ_LEN, update=None,
          inner=None, model=None, overlap=False, tier_keys=None, **compression):
    extra = {} if model is None else {"model": {"inline": model}}
    tables = run_tables(
        mdat, run={"id": "fed", "dir": "run"}, **extra,
        data={"path": str(mdat), "strategy": strategy, "max_seq_len": max_seq_len},
        tiers={"allowed": list(tiers), **(tier_keys or {})},
        round={"min_clients": min_clients, "deadline_s": deadline_s,
               "tokens_per_round": tokens_per_round, "rounds": rounds, "overlap": overlap},
        update={"rule": rule, "lr": lr, "schedule": "constant", **(update or {})},
        compression={"encoding": encoding, **compression}, inner=inner or {},
        checkpoint={"every_rounds": every}, auth={"join_token": TOKEN})
    return RunningServer.start(RunConfig.load(write_run_toml(tmp_path / "run.toml", tables)),
                               grpc_port=0, http_port=0)


def client(server, tmp_path, name, tier=None, **options):
    return FederatedClient(
        FederatedOptions(server=f"127.0.0.1:{server.grpc_port}", tier=tier, name=name,
                         join_token=TOKEN, state_dir=tmp_path / "clients" / name,
                         microbatch_tokens=256, progress=False, **options),
        log=lambda line: print(f"[{name}] {line}"))


class Recording(FederatedClient):
    """Remembers the sequence ids of every round it trained (the last time, if twice)."""

    trained: dict[int, list[int]]

    def train_round(self, work, progress):
        self.trained = {**getattr(self, "trained", {}), work.round: list(work.sequence_ids)}
        return super().train_round(work, progress)

    @property
    def trained_ids(self) -> list[list[int]]:
        return [self.trained[r] for r in sorted(self.trained)]


def in_thread(target):
    outcome = {}

    def run():
        try:
            outcome["value"] = target()
        except BaseException as err:  # surfaced by the test via result()
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result(timeout=120):
        thread.join(timeout)
        assert not thread.is_alive(), "the client did not finish"
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    return result


def held(c: FederatedClient) -> dict[str, torch.Tensor]:
    """The replica's weights by canonical name."""
    return {n: t.detach().clone() for n, t in canonical_state_dict(c.replica.model).items()}


def master_slice(server, c: FederatedClient) -> dict[str, torch.Tensor]:
    master = server.service.coordinator.master
    return {n: master[n][region_slices(c.replica.regions[n])] for n in c.replica.regions}


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def wait_for_round(server, r, timeout=60):
    committed(server.service.coordinator, r, timeout)


def test_one_client_dense_sgd_equals_standalone_sgd(tmp_path, mdat):
    """The backbone (docs/architecture.md, "One round"): compression dense + sgd + one client
    over gRPC gives exactly the weights of plain SGD on the same sequences, bit for bit."""
    lr = 0.05
    server = start(tmp_path, mdat, encoding="dense", rule="sgd", lr=lr, rounds=3,
                   value_dtype="float32")
    try:
        federated = Recording(client(server, tmp_path, "solo", tier=0).options,
                              log=lambda line: None)
        summary = federated.run()
        assert summary.finished and summary.rounds_trained == 3
        assert summary.resynchronisations == 0
        master = {n: t.clone() for n, t in server.service.coordinator.master.items()}
    finally:
        server.stop()

    reference = load_pretrained(tmp_path / "run" / "checkpoints" / "round-0")
    runner = MicrobatchRunner(reference, AdaptiveLimitsConfig(max_tokens=256).build())
    sgd = torch.optim.SGD(reference.parameters(), lr=lr)
    reader = server.service.coordinator.reader
    for step, ids in enumerate(federated.trained_ids):
        examples = [torch.from_numpy(reader[i].copy()).long() for i in ids]
        rows = pack_rows([len(e) for e in examples], SEQ_LEN)  # as the client packs them
        train_step_on_examples(runner, sgd, examples, TierSchedule(tiers=[0]), step, rows=rows)
    standalone = canonical_state_dict(reference)
    assert same(held(federated), standalone)
    assert all(torch.equal(master[n], standalone[n]) for n in standalone)
    start_weights = canonical_state_dict(load_pretrained(
        tmp_path / "run" / "checkpoints" / "round-0"))
    assert not same(start_weights, standalone)  # the run did train


def test_one_token_sequences_are_left_out_of_the_run_and_its_audit(tmp_path):
    # Each round of 8 tokens would otherwise often be the documents' one-token tails alone.
    data = mdat_with_one_token_tails(tmp_path / "tails.mdat")
    server = start(tmp_path, data, rounds=6, tokens_per_round=8, strategy=TAILS_STRATEGY,
                   max_seq_len=8)
    try:
        summary = client(server, tmp_path, "solo", tier=0).run()
        coordinator = server.service.coordinator
    finally:
        server.stop()
    assert summary.finished and summary.rounds_trained == 6
    total = len(coordinator.reader)
    assert [e["detail"] for e in coordinator.state.events if e["kind"] == "data"] == [
        f"left out 40 of {total} sequences, of fewer than 2 tokens: they carry no target"]
    assert coordinator.queue.order.candidates == total - 40
    config = RunConfig.load(tmp_path / "run.toml")
    audit = audit_run(config)  # derives the same order as the coordinator
    assert audit.exactly_once and audit.trained == 6
    assert audit.sequences == len(coordinator.queue.order.training)  # the tail held out
    losses = HeldOut.of(config).loss(tmp_path / "run" / "checkpoints" / "round-6", tiers=[0])
    assert math.isfinite(losses[0])


INNER = {"batch_tokens": 256, "optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.1,
         "warmup_steps": 3, "schedule": "cosine", "final_lr": 2e-4, "grad_clip": 0.5}
OUTER = {"momentum": 0.9, "nesterov": True}  # with rule sgd, lr 0.7: DiLoCo's outer step


@pytest.mark.parametrize("interruption", [None, "restart", "refused"])
def test_local_adamw_steps_under_outer_sgd_lr_1_equal_standalone_adamw(tmp_path, mdat,
                                                                       interruption):
    """One client, dense float64 results, H local AdamW steps per round and an outer SGD
    step of lr 1 without momentum: the master is exactly where H standalone AdamW steps on
    the same batches take the weights, with the same lr at each step (warmup over the
    client's steps, cosine over the run's 4 rounds), each step's gradient clipped alike.
    The inner optimizer's state survives a
    client restart and rolls back with a refused submission, or the weights would differ."""
    server = start(tmp_path, mdat, encoding="dense", value_dtype="float64", rule="sgd", lr=1.0,
                   rounds=4, tokens_per_round=1024, inner=INNER)
    trained = {}
    try:
        first = Recording(client(server, tmp_path, "solo", tier=0,
                                 max_rounds=2 if interruption == "restart" else None).options,
                          log=lambda line: None)
        if interruption == "refused":  # the second submission is refused after training
            submit, calls = first.connection.submit, []

            def refuse_once(work, **kwargs):
                calls.append(work.round)
                if len(calls) == 2:
                    raise RoundOver("SubmitResult", "FAILED_PRECONDITION", "refused by the test")
                return submit(work, **kwargs)

            first.connection.submit = refuse_once
        summaries = [first.run()]
        trained |= first.trained
        if interruption == "restart":
            assert not summaries[0].finished
            again = Recording(client(server, tmp_path, "solo", tier=0).options,
                              log=lambda line: None)
            summaries.append(again.run())
            trained |= again.trained
        master = {n: t.clone() for n, t in server.service.coordinator.master.items()}
    finally:
        server.stop()
    assert summaries[-1].finished and sum(s.rounds_trained for s in summaries) == 4
    assert all(s.resynchronisations == 0 for s in summaries)
    if interruption == "refused":
        assert calls == [0, 1, 1, 2, 3]  # round 1 trained again from the rolled-back state

    reference = load_pretrained(tmp_path / "run" / "checkpoints" / "round-0")
    runner = MicrobatchRunner(reference, AdaptiveLimitsConfig(max_tokens=256).build())
    adamw = OptimizerConfig(name="adamw", lr=INNER["lr"], weight_decay=INNER["weight_decay"],
                            betas=(0.9, 0.95), warmup_steps=INNER["warmup_steps"],
                            schedule="constant").build(reference)
    reader = server.service.coordinator.reader
    steps = 0
    for r in sorted(trained):
        adamw.scale_lr(lr_factor(r, warmup_steps=0, total_steps=4, schedule="cosine",
                                 min_ratio=INNER["final_lr"] / INNER["lr"]))
        examples = [torch.from_numpy(reader[i].copy()).long() for i in trained[r]]
        for rows in plan_packed([len(e) for e in examples], INNER["batch_tokens"], SEQ_LEN):
            batch = [i for row in rows for i in row]
            position = {index: n for n, index in enumerate(batch)}
            train_step_on_examples(runner, adamw, [examples[i] for i in batch],
                                   TierSchedule(tiers=[0]), r, INNER["grad_clip"],
                                   rows=[[position[i] for i in row] for row in rows])
            adamw.zero_grad()
            steps += 1
    assert steps > 4  # several inner steps per round
    standalone = canonical_state_dict(reference)
    assert all(torch.equal(master[n], standalone[n]) for n in standalone)


@pytest.mark.parametrize("local_steps, value_dtype", [(False, "bfloat16"), (True, "bfloat16"),
                                                      (True, "int2")])
def test_heterogeneous_run_tail_moves_only_with_tier0_and_hashes_agree(tmp_path, mdat,
                                                                       local_steps, value_dtype):
    """... also with 2-bit values up and 2-bit levels down: the codes travel, the
    coordinator decodes the values the members kept, and every replica still holds the
    master's slice bit for bit."""
    # chunks of 16 rows: tier 2's 16 FFN rows are a chunk fewer than tier 1's 32
    low = {"broadcast_bits": 2} if value_dtype == "int2" else {}
    outer = dict(rule="sgd", lr=0.7, update={**OUTER, **low}, inner=INNER) if local_steps else {}
    server = start(tmp_path, mdat, min_clients=2, rounds=5, tokens_per_round=1536, every=2,
                   chunk=16, value_dtype=value_dtype, **outer)
    coordinator = server.service.coordinator
    rounds = []  # (tiers that submitted, master before, master after)
    coordinator.round_closed.append(
        lambda closed: rounds.append((closed.tiers, closed.before, closed.after)))
    try:
        clients = [client(server, tmp_path, "mid", tier=1), client(server, tmp_path, "small",
                                                                    tier=2)]
        results = [in_thread(c.run) for c in clients]
        wait_for_round(server, 2)
        big = client(server, tmp_path, "big", tier=0)  # joins while the run goes on
        results.append(in_thread(big.run))
        clients.append(big)
        summaries = [r() for r in results]
        final = {n: t.clone() for n, t in coordinator.master.items()}
    finally:
        server.stop()

    assert [s.tier for s in summaries] == [1, 2, 0]
    assert all(s.finished and s.resynchronisations == 0 for s in summaries)
    assert summaries[2].rounds_trained >= 1 and summaries[0].rounds_trained == 5
    # a client downloads only its tier's part of each update
    assert summaries[1].update_bytes < summaries[0].update_bytes
    widths = {t: coordinator.regions(t)[UP][0][1] for t in (0, 1, 2)}
    for tiers, before, after in rounds:
        tail = (slice(widths[1], None), slice(None))
        middle = (slice(widths[2], widths[1]), slice(None))
        assert (not torch.equal(before[UP][tail], after[UP][tail])) == (0 in tiers)
        assert (not torch.equal(before[DOWN][:, widths[1]:], after[DOWN][:, widths[1]:])) == (
            0 in tiers)
        assert not torch.equal(before[UP][middle], after[UP][middle])  # tier 1 is always in
    assert {frozenset(t) for t, _, _ in rounds} >= {frozenset({1, 2}), frozenset({0, 1, 2})}
    for c in clients:  # every replica holds exactly the master's slice of its tier
        assert same(held(c), {n: final[n][region_slices(c.replica.regions[n])]
                              for n in c.replica.regions})
    status = coordinator.state.loss
    assert set(status) == {"0", "1", "2"}


def test_a_member_trains_a_mix_n_match_slice_as_its_tier(tmp_path, mdat):
    """[tiers] layer_mixes: tier 64 is layer 0 at tier 1 and layer 1 at tier 2. The member
    pinned to it loads the checkpoint's mix-1-2 slice (not the universal weights), trains it
    with local steps, and its replica stays the master's slice of the mix bit for bit; the
    neurons only tier 0 holds move only when tier 0 trains."""
    server = start(tmp_path, mdat, min_clients=2, rounds=4, tokens_per_round=1536, every=2,
                   chunk=16, value_dtype="int4", rule="sgd", lr=0.7, update=OUTER, inner=INNER,
                   tier_keys={"layer_mixes": [[1, 2]], "pins": {"mixed": 64}})
    coordinator = server.service.coordinator
    rounds = []
    coordinator.round_closed.append(
        lambda closed: rounds.append((closed.tiers, closed.before, closed.after)))
    try:
        clients = [client(server, tmp_path, "mixed"), client(server, tmp_path, "big", tier=0)]
        summaries = [r() for r in [in_thread(c.run) for c in clients]]
        final = {n: t.clone() for n, t in coordinator.master.items()}
        checkpoint = coordinator.checkpoints.path(coordinator.state.checkpoints[-1])
    finally:
        server.stop()

    assert [s.tier for s in summaries] == [64, 0]
    assert all(s.finished and s.resynchronisations == 0 for s in summaries)
    mixed = clients[0]
    assert mixed.replica.config.stored_tiers() == [1, 2]  # the slice, as exported
    assert (checkpoint / "mix-1-2" / "config.json").is_file()
    up1 = UP.replace("layers.0", "layers.1")
    assert mixed.replica.regions[UP] == ((0, 32), (0, 32))
    assert mixed.replica.regions[up1] == ((0, 16), (0, 32))
    for c in clients:
        assert same(held(c), {n: final[n][region_slices(c.replica.regions[n])]
                              for n in c.replica.regions})
    for tiers, before, after in rounds:
        assert tiers >= {64}  # the pinned member trains every round
        # layer 1's rows 16..32 belong to tier 0 and 1, not to the mix
        assert (not torch.equal(before[up1][16:32], after[up1][16:32])) == (0 in tiers)
        assert not torch.equal(before[UP][16:32], after[UP][16:32])  # layer 0: the mix's
    assert "64" in coordinator.state.loss


def test_leave_and_rejoin_ends_with_the_same_weights(tmp_path, mdat):
    server = start(tmp_path, mdat, rounds=6, every=2)
    try:
        steady = client(server, tmp_path, "steady", tier=1)
        steady_result = in_thread(steady.run)
        wait_for_round(server, 1)
        first = client(server, tmp_path, "wanderer", tier=1, max_rounds=1).run()
        assert not first.finished and first.rounds_trained == 1  # it left the run
        feedback = tmp_path / "clients" / "wanderer" / "error_feedback.safetensors"
        assert feedback.is_file()
        wait_for_round(server, 4)  # the run goes on without it, past a checkpoint
        back = client(server, tmp_path, "wanderer", tier=1)
        back_summary = back.run()
        steady_summary = steady_result()
        final = master_slice(server, steady)
    finally:
        server.stop()
    assert back_summary.finished and steady_summary.finished
    assert back_summary.client_id != first.client_id  # a new member
    assert back_summary.rounds_applied == steady_summary.rounds_applied == 6
    assert same(held(back), held(steady)) and same(held(steady), final)


def test_catching_up_reloads_once_when_the_log_is_pruned_or_a_hash_disagrees(tmp_path, mdat,
                                                                             monkeypatch):
    """The catch-up loop: a replica behind the log's start reloads the latest checkpoint; a
    replica whose hash disagrees reloads and replays; a disagreement that survives the reload
    is damage, and says so."""
    server = start(tmp_path, mdat, rounds=6, every=1, deadline_s=300.0)
    try:
        client(server, tmp_path, "first", tier=1, max_rounds=3).run()
        wait_for_round(server, 3)
        logs: list[str] = []
        late = FederatedClient(client(server, tmp_path, "late", tier=1).options,
                               log=logs.append)
        late.join()  # at the latest checkpoint, round 3; the log keeps rounds 2 on
        coordinator = server.service.coordinator
        published = coordinator.tier_hashes([late.tier])[late.tier]
        assert late.applied == 3 and late.replica.hash(late.tier) == published

        late.applied = 0  # as if this machine slept since round 0
        late.catch_up()
        assert any("updates since round 0 are pruned" in line for line in logs), logs
        assert late.applied == 3 and late.summary.resynchronisations == 0
        assert late.replica.hash(late.tier) == published
        # the rounds train the reloaded replica, not the one it replaced
        assert late.local_round is None
        late.build_local_round()
        assert late.local_round.replica is late.replica

        with torch.no_grad():  # a replica one round behind whose weights drifted
            late.replica.parameters[UP][0, 0] += 1.0
        late.applied = 2
        late.catch_up()
        assert any("differs from the coordinator's; reloading" in line for line in logs), logs
        assert late.summary.resynchronisations == 1
        assert late.replica.hash(late.tier) == published

        apply = Replica.apply

        def apply_and_drift(replica, update):  # the same drift after every reload, too
            apply(replica, update)
            with torch.no_grad():
                replica.parameters[UP][0, 0] += 1.0

        monkeypatch.setattr(Replica, "apply", apply_and_drift)
        late.connection.latest_checkpoint = lambda: PublishedCheckpoint(round=2,
                                                                        folder="round-2")
        late.applied = 2
        with pytest.raises(ReplicaDiverged, match="after reloading the latest checkpoint"):
            late.catch_up()
        assert late.summary.resynchronisations == 3
        late.leave("done")
    finally:
        server.stop()


def test_local_data_must_match_the_runs_fingerprint(tmp_path, mdat):
    server = start(tmp_path, mdat, rounds=1)
    other = tmp_path / "other.mdat"
    build_default_mdat(other, limit=20).close()
    try:
        with pytest.raises(DataMismatch, match="fingerprint"):
            client(server, tmp_path, "stranger", tier=0, data=other).run()
        local = client(server, tmp_path, "local", tier=0, data=mdat).run()
        assert local.finished and local.rounds_trained == 1
    finally:
        server.stop()


def _forged(coordinator, client_id, fault):
    """A tier-1 client's results with one ``fault``; the good ones when fault is None."""
    from matformer.modeling.compression import CompressionConfig

    tier = coordinator.membership.get(client_id).tier
    regions, shapes = coordinator.regions(tier), coordinator.shapes
    tokens = coordinator.assignment_for(client_id).tokens
    dense, topk = (CompressionConfig(encoding=e, chunk=8, topk=2).build()
                   for e in ("dense", "topk"))
    out = [dense.encode(n, torch.full([b - a for a, b in regions[n]], 0.01), shape=shapes[n],
                        region=regions[n], tokens=tokens) for n in sorted(shapes)]
    if fault == "unknown name":
        out[0] = dataclasses.replace(out[0], name="model.layers.99.mlp.up_proj.weight")
    elif fault == "not its slice":
        full = tuple((0, s) for s in shapes[UP])
        i = next(i for i, r in enumerate(out) if r.name == UP)
        out[i] = dense.encode(UP, torch.zeros(shapes[UP]), shape=shapes[UP], region=full,
                              tokens=tokens)
    elif fault == "index out of range":
        i = next(i for i, r in enumerate(out) if r.name == UP)
        bad = topk.encode(UP, torch.randn([b - a for a, b in regions[UP]]), shape=shapes[UP],
                          region=regions[UP], tokens=tokens)
        bad.indices[0, 0] = 10**6
        out[i] = bad
    elif fault == "infinite value":
        out[0].values.view(-1)[0] = float("inf")
    return out


@pytest.mark.parametrize("fault", ["unknown name", "not its slice", "index out of range",
                                   "infinite value", "stale round", "duplicate"])
def test_bad_results_are_refused_over_grpc_and_change_nothing(tmp_path, mdat, fault):
    import grpc

    from matformer.protocol.auth import session_metadata
    from matformer.protocol.channel import GRPC_OPTIONS
    from matformer.protocol.matformer.v1 import coordinator_pb2 as pb
    from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
    from matformer.protocol.submission import submission_messages

    server = start(tmp_path, mdat, encoding="dense", rule="sgd", rounds=2)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", options=GRPC_OPTIONS)
    try:
        stub, c = pb_grpc.CoordinatorStub(channel), server.service.coordinator
        joined = stub.Join(pb.JoinRequest(
            join_token=TOKEN, client_name="mallory",
            capabilities=pb.Capabilities(device_kind="cpu", memory_bytes=2**34,
                                         requested_tier=1, tokens_per_second=1000.0)))
        auth = session_metadata(joined.session_token)  # ready to train: a speed measured
        work = stub.GetRound(pb.GetRoundRequest(), metadata=auth)
        assert work.state == pb.ROUND_STATE_TRAIN

        def submit(results, round_index=work.round):
            header = pb.SubmitHeader(round=round_index, client_id=joined.client_id, loss=2.0,
                                     assignment_id=work.assignment_id)
            return stub.SubmitResult(submission_messages(header, results), metadata=auth)

        if fault == "duplicate":
            # a second copy of one parameter in the same stream
            good = _forged(c, joined.client_id, None)
            bad, round_index = [*good, good[0]], work.round
        else:
            bad = _forged(c, joined.client_id, None if fault == "stale round" else fault)
            round_index = work.round + 5 if fault == "stale round" else work.round
        before = {n: t.clone() for n, t in c.master.items()}
        with pytest.raises(grpc.RpcError) as refused:
            submit(bad, round_index)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
        assert same(before, c.master) and c.current_round.submissions == {}
        assert c.state.round == 0
        # the same client's good results still count afterwards
        assert submit(_forged(c, joined.client_id, None)).accepted == len(c.shapes)
        wait_for_round(server, 1)
    finally:
        channel.close()
        server.stop()


def test_checkpoint_files_come_from_a_local_copy_when_their_sha256_matches(tmp_path, mdat):
    import shutil

    server = start(tmp_path, mdat, rounds=1)
    try:
        mirror = tmp_path / "mirror"
        shutil.copytree(tmp_path / "run" / "checkpoints", mirror)
        logs = []
        c = FederatedClient(FederatedOptions(
            server=f"127.0.0.1:{server.grpc_port}", tier=1, name="mirrored", join_token=TOKEN,
            state_dir=tmp_path / "clients" / "m", checkpoint=str(mirror), progress=False,
            max_rounds=0), log=logs.append)
        c.run()
        # only the manifest comes from the coordinator; config, weights and the tokenizer's
        # two files from the copy
        assert any(f"1 files downloaded, 5 from {mirror}" in line for line in logs), logs
        # a tampered copy is not used: the file comes from the coordinator instead
        weights = next((mirror / "round-0" / "tier2").glob("*.safetensors"))
        weights.write_bytes(weights.read_bytes()[:-8] + b"tampered")
        logs.clear()
        c = FederatedClient(dataclasses.replace(c.options, tier=2, name="wary",
                                                state_dir=tmp_path / "clients" / "w"),
                            log=logs.append)
        c.run()
        assert any(f"2 files downloaded, 4 from {mirror}" in line for line in logs), logs
        assert same(held(c), master_slice(server, c))
    finally:
        server.stop()


def client_command(server, tmp_path, *, ignoring_sigint: bool = False):
    """``matformer-client train`` as a process, training in the run of ``server``;
    ``ignoring_sigint``: started as a shell starts a background job (``cmd &``), with SIGINT
    ignored."""
    import os
    import subprocess
    import sys

    command = [sys.executable, "-m", "matformer.client.cli", "train", "--server",
               f"127.0.0.1:{server.grpc_port}", "--join-token", TOKEN, "--name", "leaver",
               "--state-dir", str(tmp_path / "leaver"), "--no-progress"]
    if ignoring_sigint:  # exec keeps the ignored SIGINT, as it does for a background job
        command = ["sh", "-c", 'trap "" INT; exec "$0" "$@"', *command]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("signal_name, ignoring_sigint", [
    ("SIGINT", False), ("SIGTERM", False), ("SIGINT", True)],
    ids=["SIGINT", "SIGTERM", "SIGINT-to-a-background-job"])
def test_the_client_command_leaves_the_run_on_ctrl_c_and_sigterm(tmp_path, mdat, signal_name,
                                                                 ignoring_sigint):
    import signal

    server = start(tmp_path, mdat, rounds=1000, min_clients=1)
    coordinator = server.service.coordinator
    try:
        process = client_command(server, tmp_path, ignoring_sigint=ignoring_sigint)
        wait_for_round(server, 2, timeout=90)  # it is training
        assert [m.name for m in coordinator.membership.members.values()] == ["leaver"]
        process.send_signal(getattr(signal, signal_name))
        output, _ = process.communicate(timeout=60)
        assert process.returncode == 130, output
        why = "SIGTERM" if signal_name == "SIGTERM" else "Ctrl-C"
        assert f"left the run ({why})" in output
        assert coordinator.membership.members == {}  # Leave reached the coordinator
        (leave,) = [e for e in coordinator.state.events if e["kind"] == "leave"]
        assert leave["detail"] == ("stopped (SIGTERM)" if why == "SIGTERM"
                                   else "interrupted (Ctrl-C)")
    finally:
        if process.poll() is None:
            process.kill()
        server.stop()


def test_ctrl_c_ends_a_client_whose_coordinator_is_gone(tmp_path, mdat):
    """Leaving is a courtesy: with the coordinator gone, Ctrl-C ends the client after a short
    Leave (it used to retry Leave for the 60 s a lost call is retried)."""
    import signal

    server = start(tmp_path, mdat, rounds=1000, min_clients=1)
    process = client_command(server, tmp_path)
    try:
        try:
            wait_for_round(server, 2, timeout=90)  # it is training
        finally:
            server.stop()
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=30)  # far less than the 60 s of retries
        assert process.returncode == 130, output
        assert "left the run" in output
    finally:
        if process.poll() is None:
            process.kill()


def test_a_second_client_command_on_one_machine_is_refused_at_once(tmp_path, mdat):
    """Two ``matformer-client train`` with neither --name nor --state-dir on one machine
    would share the hostname and its state folder, so one session: the second is refused
    before it joins, and says to pass --name; the first trains on undisturbed."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    from matformer.client.state_dir import held

    server = start(tmp_path, mdat, rounds=1000, min_clients=1)
    coordinator = server.service.coordinator
    command = [sys.executable, "-m", "matformer.client.cli", "train", "--server",
               f"127.0.0.1:{server.grpc_port}", "--join-token", TOKEN, "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    first = subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, env=env)
    try:
        wait_for_round(server, 2, timeout=90)  # the first is training
        (joined,) = coordinator.membership.members
        second = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True,
                                env=env, timeout=60)
        assert second.returncode == 2, second.stderr
        assert "is in use by a running client" in second.stderr
        assert f"pid {first.pid}" in second.stderr and "--name" in second.stderr
        assert list(coordinator.membership.members) == [joined]  # never joined, nor replaced
        round_now = coordinator.state.round
        wait_for_round(server, round_now + 1, timeout=90)  # the first goes on
        first.send_signal(signal.SIGINT)
        output, _ = first.communicate(timeout=60)
        assert first.returncode == 130, output
    finally:
        if first.poll() is None:
            first.kill()
        server.stop()
    # the lock went with the process: a client may take the folder again at once
    with held(tmp_path / "runs" / "clients" / socket.gethostname(), "again"):
        pass


def test_a_masked_model_trains_in_a_one_client_federated_run(tmp_path, mdat):
    model = dataclasses.asdict(tiny_config(vocab_size=260, max_position_embeddings=128,
                                           is_causal=False, mask_token_id=259))
    server = start(tmp_path, mdat, encoding="dense", rule="sgd", lr=0.5, rounds=8, tiers=(0,),
                   model={k: v for k, v in model.items() if v is not None})
    try:
        summary = client(server, tmp_path, "bert", tier=0).run()
    finally:
        server.stop()
    assert summary.finished and summary.rounds_trained == 8
    losses = [loss for _, loss in summary.losses]
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5


def test_a_two_rank_client_submits_what_one_rank_does_and_its_ranks_agree(tmp_path, mdat):
    """torchrun with 2 Gloo ranks is one participant: rank 0 alone talks to the coordinator,
    the round's rows are split over the ranks and the gradients summed before rank 0 sends
    them, and every rank applies the broadcast updates: the follower's replica hash equals
    rank 0's, which the coordinator's published hashes confirm each round."""
    import json
    import os
    import subprocess
    import sys

    settings = dict(encoding="dense", value_dtype="float64", rule="sgd", lr=0.05, rounds=3,
                    tiers=(0,))
    masters = {}
    for ranks in (2, 1):
        run = tmp_path / f"ranks{ranks}"
        run.mkdir()
        server = start(run, mdat, **settings)
        try:
            done = subprocess.run(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={ranks}", "-m", "matformer.client.cli", "train", "--server",
                 f"127.0.0.1:{server.grpc_port}", "--join-token", TOKEN, "--name", "node",
                 "--tier", "0", "--microbatch-tokens", "256", "--state-dir", str(run / "node"),
                 "--no-progress"],
                env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                timeout=300)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
            masters[ranks] = {n: t.clone() for n, t in
                              server.service.coordinator.master.items()}
        finally:
            server.stop()
        summary = json.loads((run / "node" / "summary.json").read_text())
        assert summary["finished"] and summary["rounds_trained"] == 3
        assert summary["resynchronisations"] == 0  # rank 0's hash was the coordinator's
        assert summary["world_size"] == ranks
        assert len(summary["rank_hashes"]) == ranks and len(set(summary["rank_hashes"])) == 1
    start_weights = canonical_state_dict(load_pretrained(
        tmp_path / "ranks1" / "run" / "checkpoints" / "round-0"))
    assert not all(torch.equal(masters[1][n], start_weights[n]) for n in start_weights)
    for name, weights in masters[1].items():
        torch.testing.assert_close(masters[2][name], weights, atol=1e-7, rtol=1e-5, msg=name)


def test_the_coordinator_writes_its_rounds_to_tensorboard(tmp_path, mdat):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    server = start(tmp_path, mdat, encoding="dense", rule="sgd", lr=0.05, rounds=3, tiers=(0,))
    try:
        client(server, tmp_path, "solo", tier=0).run()
    finally:
        server.stop()
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {"loss/tier_0", "round/duration_s", "round/slowest_s", "round/tokens",
                    "round/clients", "round/bytes_sent", "round/bytes_dense"}
    assert [e.step for e in events.Scalars("round/tokens")] == [1, 2, 3]
    losses = server.service.coordinator.state.loss["0"]
    assert [e.value for e in events.Scalars("loss/tier_0")] == pytest.approx(
        [loss for _, loss in losses])
