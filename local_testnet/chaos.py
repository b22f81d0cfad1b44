"""``local-testnet --chaos SEED``: kill clients and the server on a seeded schedule, then prove
nothing was lost.

    plan = chaos_plan(seed, rounds=150, clients=["member-0", "member-1", "member-2"])
    ...                                     # the testnet carries the plan out (testnet.py)
    check = check_run(config, clients)      # after the run: the ledger audit + replica hashes

The schedule holds a few client kills and exactly one server kill, each at a round chosen by
the seed, ``delay_s`` after that round opened (so kills land while clients train, submit and
while the server aggregates or writes a checkpoint), and a restart ``down_s`` later with the
same command, name and state directory. At the end the run must have trained every sequence
it handed out exactly once (``server.ledger.audit_run``), and every client still running must
hold the coordinator's weights for its tier (the ``weight_hash`` in its ``summary.json``).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path

from matformer.client.summary import SUMMARY_FILE
from matformer.server.config import RunConfig
from matformer.server.ledger import LedgerAudit, audit_run
from matformer.server.update_log import UpdateLog

SERVER = "server"


@dataclass(frozen=True, slots=True)
class ChaosEvent:
    round: int  # killed once this round is open (or later, when the run moved past it)
    target: str  # a client's name, or SERVER
    delay_s: float  # after the round is seen open
    down_s: float  # from the kill to the restart


def chaos_plan(seed: int, *, rounds: int, clients: list[str]) -> list[ChaosEvent]:
    """A few client kills and one server kill over rounds 1 .. rounds - 2, ordered by round,
    at most one per round; the same seed gives the same schedule."""
    rng = random.Random(seed)
    candidates = list(range(1, max(rounds - 1, 2)))
    kills = min(len(candidates) - 1, max(2, min(2 * len(clients), rounds // 8)))
    chosen = sorted(rng.sample(candidates, kills + 1))
    third = len(chosen) // 3
    server_at = rng.choice(chosen[third:max(third + 1, len(chosen) - third)])  # mid-run
    events = []
    for r in chosen:
        target = SERVER if r == server_at else rng.choice(clients)
        events.append(ChaosEvent(round=r, target=target, delay_s=round(rng.uniform(0.0, 0.6), 2),
                                 down_s=round(rng.uniform(0.5, 3.0), 2)))
    return events


@dataclass(kw_only=True)
class ChaosRecord:
    """What the testnet did and saw, for the report."""

    kills: list[dict] = field(default_factory=list)  # {"target", "round", "at_s"}
    skipped: list[ChaosEvent] = field(default_factory=list)  # the run ended first
    restart_to_round_s: list[float] = field(default_factory=list)  # server restarts

    @property
    def client_kills(self) -> int:
        return sum(k["target"] != SERVER for k in self.kills)

    @property
    def server_kills(self) -> int:
        return sum(k["target"] == SERVER for k in self.kills)


@dataclass(kw_only=True)
class ChaosCheck:
    audit: LedgerAudit
    rounds: int
    replicas: dict[str, str]  # client name → "equal" or what is wrong

    @property
    def passed(self) -> bool:
        return self.audit.exactly_once and all(v == "equal" for v in self.replicas.values())


def check_run(config: RunConfig, clients: list[str]) -> ChaosCheck:
    """The end-of-run check: the ledger audit, and each client's final weight hash against
    the coordinator's hash for its tier after the last round."""
    run_dir = Path(config.run.dir)
    audit = audit_run(config)
    state = json.loads((run_dir / "state.json").read_text())
    rounds = state["round"]
    hashes = UpdateLog(run_dir / "updates").read(rounds - 1).hashes if rounds else {}
    replicas = {}
    for name in clients:
        path = run_dir / "clients" / name / SUMMARY_FILE
        if not path.is_file():
            replicas[name] = "no summary.json (it did not finish)"
            continue
        summary = json.loads(path.read_text())
        want = hashes.get(summary["tier"])
        if summary["rounds_applied"] != rounds:
            replicas[name] = f"holds {summary['rounds_applied']} of {rounds} rounds"
        elif summary["weight_hash"] != want:
            replicas[name] = (f"weight hash {summary['weight_hash'][:12]} at tier "
                              f"{summary['tier']}, the coordinator's is {str(want)[:12]}")
        else:
            replicas[name] = "equal"
    return ChaosCheck(audit=audit, rounds=rounds, replicas=replicas)


def format_chaos(record: ChaosRecord, check: ChaosCheck) -> str:
    lines = [f"chaos: {record.client_kills} client kills and {record.server_kills} server "
             f"kill(s) (SIGKILL), {len(record.skipped)} planned kill(s) skipped (the run ended "
             "first)"]
    for kill in record.kills:
        lines.append(f"  {kill['at_s']:7.1f} s  round {kill['round']:>4}  killed {kill['target']}")
    for seconds in record.restart_to_round_s:
        lines.append(f"  server restart → next completed round: {seconds:.1f} s")
    lines.append(f"  ledger: {check.audit.summary()}")
    lost = len(check.audit.lost)
    lines.append(f"  sequences lost: {lost}, trained twice: {len(check.audit.duplicated)}")
    for name, verdict in check.replicas.items():
        lines.append(f"  {name}: replica {verdict}")
    lines.append("  PASSED" if check.passed else "  FAILED")
    return "\n".join(lines)
