"""The end of a testnet run: a per-tier loss table, ``loss.png`` and ``summary.json``.

    reports = tier_reports(status, clients={0: 1, 1: 1}, initial={0: 5.6, 1: 5.6},
                           final={0: 3.1, 1: 3.3})
    print(format_table(reports))
    write_plot(status, run_dir / "loss.png")
    write_summary(run_dir / "summary.json", reports, status, wall_s=...)

``status`` is the coordinator's ``GET /status`` JSON (server/http.py), read from the same
snapshot as the dashboard's ``/api/``: ``loss`` maps a tier (a string) to
``[{"round": r, "loss": l}, ...]``, ``bytes_received`` a round (a string) to the bytes its
results took as sent (compressed), ``bytes_dense`` to what they would take as dense float32.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

NAN = float("nan")


@dataclass(kw_only=True, slots=True)
class TierReport:
    tier: int
    clients: int  # clients that trained at this tier during the run
    first_round_loss: float  # training loss its clients reported, first and last round
    last_round_loss: float
    held_out_initial: float  # held-out loss of the round-0 and the final checkpoint
    held_out_final: float

    @property
    def improved(self) -> bool:
        return self.held_out_final < self.held_out_initial


def tier_reports(status: dict[str, Any], *, clients: dict[int, int],
                 initial: dict[int, float], final: dict[int, float]) -> list[TierReport]:
    """One row per tier that was evaluated or trained, in tier order."""
    curves = training_curves(status)
    tiers = sorted(set(initial) | set(final) | set(curves))
    return [TierReport(
        tier=t, clients=clients.get(t, 0),
        first_round_loss=curves[t][0][1] if curves.get(t) else NAN,
        last_round_loss=curves[t][-1][1] if curves.get(t) else NAN,
        held_out_initial=initial.get(t, NAN), held_out_final=final.get(t, NAN),
    ) for t in tiers]


def training_curves(status: dict[str, Any]) -> dict[int, list[tuple[int, float]]]:
    """Tier → [(round, loss)] from /status, in round order."""
    return {int(tier): sorted((int(p["round"]), float(p["loss"])) for p in points)
            for tier, points in status.get("loss", {}).items()}


def format_table(reports: list[TierReport]) -> str:
    header = ("tier", "clients", "first-round loss", "last-round loss", "held-out loss")
    rows = [(str(r.tier), str(r.clients), f"{r.first_round_loss:.3f}",
             f"{r.last_round_loss:.3f}",
             f"{r.held_out_initial:.3f} → {r.held_out_final:.3f}") for r in reports]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in [header, *rows]]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def write_plot(status: dict[str, Any], path: Path,
               costs: dict[str, dict[str, Any]] | None = None) -> Path | None:
    """Training loss per tier over rounds, the bytes of each round's results as sent
    (compressed) against dense float32 (the dashboard's two charts), and with ``costs``
    (``client_costs``) what each client moved up and down against dense both ways. None when
    matplotlib (the ``plot`` extra) is not installed."""
    try:
        import matplotlib
    except ImportError:
        return None  # an optional extra: pip install 'matformer[plot]'
    matplotlib.use("Agg")  # files only: no display on a server or in CI
    import matplotlib.pyplot as plt  # after choosing the backend

    costs = costs or {}
    fig, axes = plt.subplots(1, 3 if costs else 2, figsize=(16 if costs else 11, 4))
    losses, sent = axes[:2]
    curves = {t: c for t, c in sorted(training_curves(status).items()) if c}
    for tier, curve in curves.items():
        rounds, values = zip(*curve, strict=True)
        losses.plot(rounds, values, marker=".", label=f"tier {tier}")
    losses.set(xlabel="round", ylabel="training loss (nats/token)",
               title="training loss per tier")
    if curves:
        losses.legend()
    series = [("bytes_dense", "dense float32", "tab:gray"),
              ("bytes_received", "sent (compressed)", "tab:blue")]
    drawn = []
    for key, label, colour in series:
        points = sorted((int(r), b) for r, b in status.get(key, {}).items() if b > 0)
        if points:
            rounds, sizes = zip(*points, strict=True)
            sent.plot(rounds, [b / 1024 for b in sizes], drawstyle="steps-mid", marker=".",
                      color=colour, label=label)
            drawn.append(sum(sizes))
    if drawn:
        sent.set_yscale("log")  # dense is tens of times the compressed size
        sent.legend()
    ratio = (f" (dense / sent: {drawn[0] / drawn[1]:.1f}×)" if len(drawn) == 2 and drawn[1]
             else "")
    sent.set(xlabel="round", ylabel="KiB", title=f"results per round{ratio}")
    if costs:
        _cost_bars(axes[2], costs)
    fig.suptitle(f"run {status.get('run_id', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def moved_mib(costs: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per client, MiB up, down, and dense float32 both ways: the cost panel's bars."""
    return {name: {"up": c["bytes_up"] / 2**20, "down": c["bytes_down"] / 2**20,
                   "dense": (c["dense_bytes_up"] + c["dense_bytes_down"]) / 2**20}
            for name, c in costs.items()}


def _cost_bars(axis: Any, costs: dict[str, dict[str, Any]]) -> None:
    bars = moved_mib(costs)
    names = list(bars)
    width = 0.27
    for i, (key, label, colour) in enumerate([("up", "sent", "tab:blue"),
                                              ("down", "received", "tab:orange"),
                                              ("dense", "dense float32 both ways", "tab:gray")]):
        axis.bar([n + (i - 1) * width for n in range(len(names))],
                 [bars[name][key] for name in names], width, label=label, color=colour)
    axis.set_xticks(range(len(names)), [f"{n}\ntier {costs[n]['tier']}" for n in names])
    axis.set_yscale("log")
    top = max(max(b.values()) for b in bars.values())
    axis.set_ylim(top=top * 30)  # room above the bars for the legend
    axis.set(ylabel="MiB", title="what each client moved, whole run")
    axis.legend(fontsize="small", loc="upper left", ncols=3)


def write_summary(path: Path, reports: list[TierReport], status: dict[str, Any],
                  **extra: Any) -> Path:
    """The table's numbers (NaN as null), the curves and ``extra`` as JSON."""
    summary = {
        "run_id": status.get("run_id"), "rounds": status.get("round"),
        "tokens": status.get("tokens"), **extra,
        "tiers": [{**_finite(asdict(r)), "improved": r.improved} for r in reports],
        "loss": {str(t): curve for t, curve in training_curves(status).items()},
        "bytes_received": {str(r): b for r, b in status.get("bytes_received", {}).items()},
        "bytes_dense": {str(r): b for r, b in status.get("bytes_dense", {}).items()},
    }
    path.write_text(json.dumps(summary, indent=1) + "\n")
    return path


def add_to_summary(path: Path, key: str, value: Any) -> None:
    """``summary.json`` with ``key`` set to ``value``."""
    summary = json.loads(path.read_text()) if path.is_file() else {}
    summary[key] = value
    path.write_text(json.dumps(summary, indent=1) + "\n")


def relay_traffic(status: dict[str, Any], relays: list[dict[str, Any]],
                  costs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Bytes per round at the root (what its members, the relays, sent and received, as each
    relay's summary counts them: the root forgets a member once it leaves) against what the
    clients behind the relays sent and received (their own summaries): sequences, results,
    updates and checkpoint files alike."""
    rounds = max(int(status.get("round") or 0), 1)
    return {
        "relays": len(relays), "members": len(costs), "rounds": rounds,
        "root_bytes_in_per_round": sum(r["bytes_up"] for r in relays) / rounds,
        "root_bytes_out_per_round": sum(r["bytes_down"] for r in relays) / rounds,
        "members_bytes_up_per_round": sum(c["bytes_up"] for c in costs.values()) / rounds,
        "members_bytes_down_per_round": sum(c["bytes_down"] for c in costs.values()) / rounds,
    }


def format_relay_traffic(t: dict[str, Any]) -> str:
    kib = 1024
    relays = f"{t['relays']} relay{'' if t['relays'] == 1 else 's'}"
    return (f"through {relays}: the root received "
            f"{t['root_bytes_in_per_round'] / kib:,.1f} KiB and sent "
            f"{t['root_bytes_out_per_round'] / kib:,.1f} KiB per round; its {t['members']} "
            f"clients sent {t['members_bytes_up_per_round'] / kib:,.1f} KiB and received "
            f"{t['members_bytes_down_per_round'] / kib:,.1f} KiB per round")


COST_KEYS = ("bytes_up", "bytes_down", "dense_bytes_up", "dense_bytes_down", "compute_s",
             "up_s", "down_s", "wait_s", "apply_s", "wall_s", "heartbeat_gap_s")


def relay_summaries(relays_dir: Path, names: list[str]) -> list[dict[str, Any]]:
    """The summary each relay wrote in its folder when it stopped (relay.relay.SUMMARY_FILE)."""
    paths = [relays_dir / name / "summary.json" for name in names]
    return [json.loads(path.read_text()) for path in paths if path.is_file()]


def client_costs(clients_dir: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Each client's cost as its ``summary.json`` (in its state dir) records it: bytes each
    way against dense float32 each way, and seconds computing, moving, waiting and in all."""
    costs = {}
    for name in names:
        path = clients_dir / name / "summary.json"
        if path.is_file():
            saved = json.loads(path.read_text())
            costs[name] = {"tier": saved["tier"], **{k: saved.get(k, 0) for k in COST_KEYS}}
    return costs


def format_costs(costs: dict[str, dict[str, Any]]) -> str:
    """One line per client: MiB up and down, how far below dense float32 both ways, and the
    share of its wall time spent computing."""
    lines = []
    for name, c in costs.items():
        moved = c["bytes_up"] + c["bytes_down"]
        below = (c["dense_bytes_up"] + c["dense_bytes_down"]) / moved if moved else NAN
        busy = c["compute_s"] / c["wall_s"] if c["wall_s"] else NAN
        lines.append(
            f"{name} (tier {c['tier']}): up {c['bytes_up'] / 2**20:,.1f} MiB, down "
            f"{c['bytes_down'] / 2**20:,.1f} MiB, {below:,.1f}x below dense float32 both "
            f"ways; computing {busy:.0%} of {c['wall_s']:,.0f} s (up {c['up_s']:,.1f} s, "
            f"down {c['down_s']:,.1f} s, waiting {c['wait_s']:,.1f} s, applying "
            f"{c['apply_s']:,.1f} s); heartbeats at most {c['heartbeat_gap_s']:,.1f} s apart")
    return "\n".join(lines)


def _finite(row: dict[str, Any]) -> dict[str, Any]:
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in row.items()}
