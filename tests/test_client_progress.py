"""A client's progress against how far the run goes: ``Progress`` on its own (plain log
lines, and a real tqdm bar), and the run's stop reaching real clients from a real coordinator
on loopback, for a run that stops by rounds and one that stops by tokens."""

from __future__ import annotations

import re

import grpc
import pytest
from support.helpers import JOIN_TOKEN, run_tables, write_run_toml
from support.wire import join_request

from matformer.client.connection import Finished, Train
from matformer.client.federated import FederatedClient, FederatedOptions
from matformer.client.progress import Planned, Progress
from matformer.modeling.mdat import build_default_mdat
from matformer.protocol.channel import GRPC_OPTIONS
from matformer.protocol.matformer.v1 import coordinator_pb2_grpc as pb_grpc
from matformer.server.config import RunConfig
from matformer.server.main import RunningServer

LEFT = r"  left \d+m\d\ds$"  # the time left, at the pace so far


def trained(round_index: int, run_tokens: int = 0) -> Train:
    return Train(round=round_index, tier=0, sequence_ids=(1, 2), assignment_id="a",
                 run_tokens=run_tokens)


def lines_of(planned: Planned, works: list[Train]) -> list[str]:
    lines: list[str] = []
    with Progress(lines.append, bar=False, planned=planned) as progress:
        for work in works:
            progress.update(work, 0, 4.0, 1000.0, 2048, 3)
    return lines


def test_a_run_of_m_rounds_shows_round_n_of_m_and_the_time_left():
    lines = lines_of(Planned(rounds=5), [trained(0), trained(1), trained(2)])
    assert [line.split("  tier")[0] for line in lines] == [
        "round    1/5", "round    2/5", "round    3/5"]
    assert not re.search(LEFT, lines[0])  # no pace yet
    assert all(re.search(LEFT, line) for line in lines[1:]), lines


def test_a_run_of_t_tokens_shows_the_runs_tokens_of_t():
    lines = lines_of(Planned(tokens=4096), [trained(0, 0), trained(1, 1024), trained(2, 2048)])
    assert [line.split("  tier")[0] for line in lines] == [
        "round    1  run tokens 0/4,096", "round    2  run tokens 1,024/4,096",
        "round    3  run tokens 2,048/4,096"]
    assert all(re.search(LEFT, line) for line in lines[1:]), lines


def test_without_a_stop_the_line_says_the_round_alone():
    (line,) = lines_of(Planned(), [trained(6)])
    assert line.startswith("round    7  tier 0  loss 4.000") and not re.search(LEFT, line)


def test_the_bar_has_the_runs_total():
    with Progress(print, bar=True, planned=Planned(rounds=20)) as progress:
        progress.update(trained(3), 0, 4.0, 1000.0, 2048, 3)
        progress.update(trained(4), 0, 3.9, 1000.0, 2048, 3)
        assert (progress.bar.n, progress.bar.total, progress.bar.unit) == (5, 20, "round")
        progress.finished(Finished(round=20, run_tokens=20_480))
        assert progress.bar.n == 20
    with Progress(print, bar=True, planned=Planned(tokens=10_000)) as progress:
        progress.update(trained(0, 0), 0, 4.0, 1000.0, 2048, 3)
        progress.update(trained(1, 1024), 0, 4.0, 1000.0, 2048, 3)
        assert (progress.bar.n, progress.bar.total, progress.bar.unit) == (1024, 10_000, "tok")
        progress.finished(Finished(round=10, run_tokens=10_240))
        assert progress.bar.n == 10_240


# -- the stop, from a real coordinator ------------------------------------------------------

@pytest.fixture(scope="module")
def mdat(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "docs.mdat"
    build_default_mdat(path, limit=40).close()
    return path


def serve(tmp_path, mdat, **stop) -> RunningServer:
    """A run of 1,024-token rounds that stops as ``stop`` says (rounds, tokens)."""
    tables = run_tables(mdat, run={"id": "svc-test", "dir": "run"},  # wire.join_request's
                        round={"min_clients": 1, "deadline_s": 30.0, "tokens_per_round": 1024,
                               **stop})
    config = RunConfig.load(write_run_toml(tmp_path / "run.toml", tables))
    return RunningServer.start(config, grpc_port=0, http_port=0)


@pytest.mark.parametrize("stop, planned", [
    ({"rounds": 3}, (3, 0)),
    ({"tokens": 2500}, (0, 2500)),
    ({"rounds": 2, "tokens": 10_000}, (2, 10_000)),  # 2 rounds come before 10 rounds' tokens
    ({"rounds": 10, "tokens": 2048}, (0, 2048)),  # 2 rounds' tokens come before 10 rounds
], ids=["rounds", "tokens", "rounds-first", "tokens-first"])
def test_join_says_how_far_the_run_goes(tmp_path, mdat, stop, planned):
    server = serve(tmp_path, mdat, **stop)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}",
                                   options=GRPC_OPTIONS) as channel:
            reply = pb_grpc.CoordinatorStub(channel).Join(join_request(server), timeout=30)
        assert (reply.rounds_planned, reply.tokens_planned) == planned
    finally:
        server.stop()


@pytest.mark.parametrize("stop, shown", [
    ({"rounds": 3}, r"round +(\d+)/3"),
    ({"tokens": 2500}, r"round +\d+  run tokens ([\d,]+)/2,500"),
], ids=["rounds", "tokens"])
def test_a_client_shows_its_progress_against_the_coordinators_stop(tmp_path, mdat, stop, shown):
    server = serve(tmp_path, mdat, **stop)
    lines: list[str] = []
    try:
        client = FederatedClient(FederatedOptions(
            server=f"127.0.0.1:{server.grpc_port}", name="counted", join_token=JOIN_TOKEN,
            state_dir=tmp_path / "counted", microbatch_tokens=256, progress=False),
            log=lines.append)
        assert client.run().finished
        run_tokens = server.service.coordinator.state.tokens
    finally:
        server.stop()
    progress = [int(m.group(1).replace(",", "")) for m in map(re.compile(shown).match, lines)
                if m]
    if "rounds" in stop:
        assert progress == [1, 2, 3], lines
    else:  # the run's tokens when each round was handed out: from 0, growing, below the end
        assert progress[0] == 0 and progress == sorted(set(progress)), lines
        assert len(progress) >= 3 and progress[-1] < 2500 <= run_tokens
