"""A coordinator driven in-process, as the server tests drive it: members' capabilities,
dense results of an assignment, whole rounds, and a disk that is full."""

from __future__ import annotations

import errno
import time

import torch

from matformer.modeling.compression import CompressionConfig, SparseResult, region_shape
from matformer.server.coordinator import Coordinator
from matformer.server.tiers import Capabilities
from support.helpers import Clock

DENSE = CompressionConfig(encoding="dense").build()


def caps(name: str, tier: int = 0, tps: float = 1000.0) -> Capabilities:
    return Capabilities(name=name, device_kind="cpu", memory_bytes=2**34, requested_tier=tier,
                        tokens_per_second=tps, microbatch_tokens=128)


def gradient(coordinator: Coordinator, name: str, round_index: int, salt: int = 0):
    """A deterministic universal-shape 'gradient' per (parameter, round, client salt)."""
    gen = torch.Generator().manual_seed(hash((name, round_index, salt)) % 2**31)
    return torch.randn(coordinator.shapes[name], generator=gen)


def assigned(coordinator: Coordinator, client_id: str, timeout_s: float = 60.0):
    """The client's oldest assignment. A server closes rounds on its close worker, after the
    last submission's call has returned, so the next round may open a moment later: wait
    for it (a coordinator driven in-process answers at once)."""
    give_up = time.monotonic() + timeout_s
    while (assignment := coordinator.assignment_for(client_id)) is None:
        if time.monotonic() > give_up:
            raise AssertionError(f"{client_id} got no assignment within {timeout_s:g} s")
        time.sleep(0.01)
    return assignment


def committed(coordinator: Coordinator, rounds: int, timeout_s: float = 60.0) -> None:
    """Until the coordinator has committed ``rounds`` rounds (its close worker runs them),
    the close's commit whole: the round counter, the master and the records."""
    coordinator.wait_for_round(rounds - 1, timeout_s)  # under the lock the commit holds
    if coordinator.state.round < rounds:
        raise AssertionError(f"round {rounds - 1} did not close within {timeout_s:g} s")


def results(coordinator, client_id, *, salt=0, names=None, tokens=None, assignment=None
            ) -> list[SparseResult]:
    """Dense results of one client at its tier, for every (or the named) parameter, of its
    oldest assignment (or ``assignment``)."""
    assignment = assignment or assigned(coordinator, client_id)
    regions = coordinator.regions(assignment.tier)
    out = []
    for name in names or sorted(coordinator.shapes):
        grad = gradient(coordinator, name, assignment.round, salt)
        region = regions[name]
        values = grad[tuple(slice(a, b) for a, b in region)]
        assert tuple(values.shape) == region_shape(region)
        out.append(DENSE.encode(name, values, shape=coordinator.shapes[name], region=region,
                                tokens=tokens or assignment.tokens))
    return out


def flat_results(coordinator, client_id, *, poison=False):
    """Dense results of one client at its tier for every parameter, each value 0.01; one NaN
    if ``poison``."""
    assignment = assigned(coordinator, client_id)
    regions = coordinator.regions(assignment.tier)
    out = []
    for name in sorted(coordinator.shapes):
        values = torch.full([b - a for a, b in regions[name]], 0.01)
        if poison and not out:
            values.view(-1)[0] = float("nan")
        out.append(DENSE.encode(name, values, shape=coordinator.shapes[name],
                                region=regions[name], tokens=assignment.tokens))
    return out


def drive(c: Coordinator, clock: Clock, client_id: str, rounds: int) -> None:
    """``rounds`` rounds of ``client_id``'s results, each checkpoint they start written."""
    for _ in range(rounds):
        clock.now += 1.0
        c.submit(client_id, c.current_round.index, results(c, client_id), loss=1.0)
        c.flush()


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def events(c: Coordinator, kind: str) -> list[dict]:
    return [e for e in c.state.events if e["kind"] == kind]


def disk_full(*_, **__):
    raise OSError(errno.ENOSPC, "No space left on device")
