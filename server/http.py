"""The coordinator's HTTP side (DESIGN.md §6), on its own port:

- ``GET /status``: the run as JSON (phase, round, tokens, clients, loss per tier per round,
  bytes received per round);
- ``GET /metrics``: the same numbers in Prometheus text format;
- ``GET /files/{path}``: the run's ``checkpoints/`` directory, read-only.

It only reads the coordinator (under its lock); clients never need it.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import FileResponse, PlainTextResponse

from protocol.errors import UnsafePath
from protocol.files import resolve_inside
from server.service import CoordinatorService


def build_app(service: CoordinatorService) -> FastAPI:
    coordinator = service.coordinator
    app = FastAPI(title=f"matformer run {coordinator.config.run.id}")

    @app.get("/status")
    def status() -> dict[str, Any]:
        return run_status(service)

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> str:
        return prometheus_text(run_status(service))

    @app.get("/files/{path:path}")
    def files(path: str) -> FileResponse:
        try:
            target = resolve_inside(service.checkpoints, path)
        except UnsafePath as err:
            raise HTTPException(status_code=404, detail=str(err)) from err
        if not target.is_file():
            raise HTTPException(status_code=404, detail=f"{path} is not a checkpoint file.")
        return FileResponse(target)

    return app


def run_status(service: CoordinatorService) -> dict[str, Any]:
    c = service.coordinator
    with c._lock:  # one consistent snapshot of a coordinator that gRPC threads are changing
        now = c.clock()
        clients = [{"client_id": m.client_id, "name": m.name, "tier": m.tier,
                    "device": m.device_kind, "tokens_per_second": m.tokens_per_second,
                    "last_seen_s_ago": max(now - m.last_seen, 0.0)}
                   for m in c.membership.members.values()]
        return {"run_id": c.config.run.id, "phase": c.phase, "round": c.state.round,
                "tokens": c.state.tokens, "checkpoints": list(c.state.checkpoints),
                "clients": clients,
                "loss": {tier: [{"round": int(r), "loss": loss} for r, loss in points]
                         for tier, points in c.state.loss.items()},
                "bytes_received": {str(r): b for r, b in sorted(service.bytes_received.items())}}


def prometheus_text(status: dict[str, Any]) -> str:
    """Gauges in the Prometheus exposition format (version 0.0.4)."""
    run = f'run="{status["run_id"]}"'
    lines = [
        "# HELP matformer_round Rounds completed.", "# TYPE matformer_round gauge",
        f"matformer_round{{{run}}} {status['round']}",
        "# HELP matformer_tokens Tokens trained on.", "# TYPE matformer_tokens gauge",
        f"matformer_tokens{{{run}}} {status['tokens']}",
        "# HELP matformer_clients Members of the run.", "# TYPE matformer_clients gauge",
        f"matformer_clients{{{run}}} {len(status['clients'])}",
        "# HELP matformer_loss Mean training loss of the last completed round, per tier.",
        "# TYPE matformer_loss gauge",
    ]
    for tier, points in sorted(status["loss"].items()):
        if points:
            lines.append(f'matformer_loss{{{run},tier="{tier}"}} {points[-1]["loss"]}')
    return "\n".join(lines) + "\n"
