"""What a participant did and what it cost: ``summary.json`` in its state dir, written when
it stops (local-testnet's end-of-run check and the benchmarks read it)."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from matformer.client.connection import Connection

SUMMARY_FILE = "summary.json"  # written in the state dir when the client stops
DOWNLOADS = ("GetUpdates", "FetchSequences", "DownloadCheckpoint")  # the calls that download
UNTIMED = ("Heartbeat",)  # calls that follow the clock, not the rounds (rpcs_per_round)


@dataclass(kw_only=True)
class ClientSummary:
    client_id: str
    tier: int
    rounds_trained: int = 0
    rounds_applied: int = 0  # the replica holds the weights after this many rounds
    resynchronisations: int = 0
    advanced: int = 0  # overlapped rounds whose predecessor's update arrived while they trained
    losses: list[tuple[int, float]] = field(default_factory=list)  # (round, loss)
    bytes_sent: int = 0
    update_bytes: int = 0  # GetUpdates messages received (before gRPC's gzip)
    finished: bool = False  # the coordinator said the run is over
    weight_hash: str = ""  # the replica's, at its tier, after ``rounds_applied`` rounds
    rejoins: int = 0  # times it joined again after its session ended
    world_size: int = 1  # data-parallel ranks of this participant (torchrun)
    threads: int = 0  # CPU threads torch computed with (modeling/threads.py)
    rank_hashes: list[str] = field(default_factory=list)  # each rank's replica, at the end
    # What it cost, over the whole process (rejoins included): every message each way as
    # serialized (before gRPC's gzip), against float32 of the tier's weights per round
    # trained (up) and applied (down); seconds training, sending results, downloading
    # (updates, sequences, checkpoint files), waiting for a round (with overlapped rounds:
    # for the transfers, which otherwise run beside the training), applying updates and
    # checking the replica's hash, and in all.
    bytes_up: int = 0
    bytes_down: int = 0
    dense_bytes_up: int = 0
    dense_bytes_down: int = 0
    compute_s: float = 0.0
    up_s: float = 0.0
    down_s: float = 0.0
    wait_s: float = 0.0
    apply_s: float = 0.0
    wall_s: float = 0.0
    # calls made, by RPC (each try counts), and per round trained: every call but the
    # heartbeats, which follow the clock rather than the rounds
    rpcs: dict[str, int] = field(default_factory=dict)
    rpcs_per_round: float = 0.0
    # the longest time between two heartbeats it sent (every [faults] heartbeat_s while it
    # trains, loads or catches up): beside busy work, how late its heartbeat thread ran
    heartbeat_gap_s: float = 0.0


@dataclass
class Cost:
    """What the summary's cost fields add up, kept across rejoins."""

    started: float = field(default_factory=time.monotonic)
    compute_s: float = 0.0
    wait_s: float = 0.0
    apply_s: float = 0.0
    dense_up: int = 0  # float32 bytes of the tier's weights, per round trained
    dense_down: int = 0  # ... per round applied


def write_summary(summary: ClientSummary, cost: Cost, connection: Connection, weight_hash: str,
                  state_dir: Path) -> None:
    """``summary`` with what ``cost`` and ``connection`` counted, as ``state_dir``'s
    summary.json."""
    seconds = connection.call_seconds
    summary.weight_hash = weight_hash or summary.weight_hash
    summary.bytes_up = connection.meter.bytes_up
    summary.bytes_down = connection.meter.bytes_down
    summary.dense_bytes_up, summary.dense_bytes_down = cost.dense_up, cost.dense_down
    summary.compute_s, summary.wait_s = round(cost.compute_s, 3), round(cost.wait_s, 3)
    summary.apply_s = round(cost.apply_s, 3)
    summary.up_s = round(seconds["SubmitResult"], 3)
    summary.down_s = round(sum(seconds[n] for n in DOWNLOADS), 3)
    summary.wall_s = round(time.monotonic() - cost.started, 3)
    summary.rpcs = dict(sorted(connection.calls.items()))
    summary.heartbeat_gap_s = round(connection.heartbeat_gap_s, 3)
    trained = summary.rounds_trained
    summary.rpcs_per_round = round(
        sum(n for name, n in summary.rpcs.items() if name not in UNTIMED) / trained, 2
    ) if trained else 0.0
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / SUMMARY_FILE
    path.write_text(json.dumps(dataclasses.asdict(summary), indent=1) + "\n")

