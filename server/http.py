"""The coordinator's HTTP side (docs/architecture.md, "Transport"), on its own port:

- ``GET /``: the dashboard (``server/static/``: plain HTML, JavaScript and SVG, nothing from
  the internet), which polls the status API;
- ``GET /api/...``: the status API (server/api.py), documented at ``/docs`` and
  ``/openapi.json``;
- ``GET /status``: the run as JSON (phase, round, tokens, clients, loss per tier per round,
  bytes received per round);
- ``GET /metrics``: the same numbers in Prometheus text format;
- ``GET /files/{path}``: the manifests of ``checkpoints/`` and the files they list, each checked
  against its sha256 first (404 for anything else, 500 for a damaged copy); ``HEAD`` answers
  the same without the body (its length and ``X-Checksum-Sha256``);
- ``GET /updates?since_round=R&tier=T`` and ``GET /blobs/sha256/{hex}``: each round's update
  per tier and each checkpoint file as an immutable, content-addressed resource any HTTP cache
  can carry (server/blobs.py; ``app.state.blobs`` counts the bodies sent, and those being
  sent per client address);
- ``POST /api/clients/{client_id}/exclude`` with ``{"reason": "..."}``: the operator removes a
  member for good (``Coordinator.exclude``; 404 for a non-member).

Reads are open; no answer holds a filesystem path of this machine, and only a read with
the operator token sees why a client was excluded (server/api.py). Every other method needs
``Authorization: Bearer <operator token>`` ([auth] operator_token_env; server/operator_access.py):
401 without it, 403 with a wrong one, 403 when the run has none (its HTTP side is then
read-only). Clients need this side only to take the broadcast from a mirror of it
(``matformer-client --mirror``).

Under load (``http_options``, [server] ``http_*``): at most ``http_connections`` connections
and requests at once (uvicorn's ``limit_concurrency``; 503 beyond), and a connection whose
client takes none of its bytes for ``http_send_timeout_s`` is aborted (``TimedSends``), which
drops what was buffered for it, so readers that never read cost the server nothing lasting.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, Field
from uvicorn.protocols.http.h11_impl import H11Protocol

from matformer.protocol.errors import UnsafePath
from matformer.server.api import build_router
from matformer.server.blobs import BlobStore, blob_router
from matformer.server.coordinator import Coordinator
from matformer.server.errors import FileNotServed, ServedFileDamaged, UnknownClient
from matformer.server.held_out_log import HeldOutLog
from matformer.server.operator_access import operator_refusal
from matformer.server.sections import ServerSection
from matformer.server.served_files import served_files

STATIC = Path(__file__).parent / "static"  # the dashboard: index.html, dashboard.js, .css
READ_METHODS = ("GET", "HEAD")  # open to all; every other method needs the operator token


class Exclusion(BaseModel):
    reason: str = Field(min_length=1, max_length=200)  # told to the client on its next call


def build_app(coordinator: Coordinator) -> FastAPI:
    app = FastAPI(title=f"matformer run {coordinator.config.run.id}")
    operator_token = coordinator.config.auth.operator()

    @app.middleware("http")
    async def operator_only_writes(request: Request,
                                   call_next: Callable[[Request], Awaitable[Response]]
                                   ) -> Response:
        if request.method in READ_METHODS:
            return await call_next(request)
        refusal = operator_refusal(request.headers.get("authorization"), operator_token)
        if refusal is not None:
            status, detail = refusal
            headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
            return JSONResponse({"detail": detail}, status_code=status, headers=headers)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        """FastAPI's own 422, but an input of bytes that are not UTF-8 (a body not sent as
        JSON) is shown with those bytes replaced: FastAPI's own answer failed on it (500)."""
        detail = jsonable_encoder(error.errors(), custom_encoder={
            bytes: lambda data: data.decode(errors="replace")})
        return JSONResponse({"detail": detail}, status_code=422)

    app.include_router(build_router(coordinator, HeldOutLog(coordinator.config.run.dir),
                                    operator_token))
    app.state.blobs = BlobStore(coordinator, coordinator.catch_up.updates,
                                served_files(coordinator.checkpoints.root),
                                coordinator.config.server.http_streams_per_client)
    app.include_router(blob_router(app.state.blobs))
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def dashboard() -> HTMLResponse:
        return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"))

    @app.get("/status")
    def status() -> dict[str, Any]:
        return run_status(coordinator)

    @app.get("/metrics", response_class=PlainTextResponse)
    def metrics() -> str:
        snap = coordinator.snapshot(since_round=None, events_after=None)
        blobs = app.state.blobs.prometheus(f'run="{snap["run_id"]}"')
        return prometheus_text(snap) + "\n".join(blobs) + "\n"

    @app.get("/files/{path:path}")
    @app.head("/files/{path:path}")
    def files(path: str) -> FileResponse:
        try:
            target, sha256 = served_files(coordinator.checkpoints.root).verified(path)
        except (UnsafePath, FileNotServed) as err:
            raise HTTPException(status_code=404, detail=str(err)) from err
        except ServedFileDamaged as err:
            raise HTTPException(status_code=500, detail=str(err)) from err
        # the digest checked, for HTTP clients to verify what they received
        return FileResponse(target, headers={"X-Checksum-Sha256": sha256} if sha256 else None)

    @app.post("/api/clients/{client_id}/exclude")
    def exclude(client_id: str, exclusion: Exclusion) -> dict[str, str]:
        try:
            coordinator.exclude(client_id, exclusion.reason)
        except UnknownClient as err:
            raise HTTPException(status_code=404, detail=str(err)) from err
        return {"client_id": client_id, "excluded": exclusion.reason}

    return app


def http_options(server: ServerSection) -> dict[str, Any]:
    """uvicorn.Config's options that bound what HTTP clients hold of the server."""
    return {"http": functools.partial(TimedSends, send_timeout_s=server.http_send_timeout_s),
            "limit_concurrency": server.http_connections}


class TimedSends(H11Protocol):
    """uvicorn's HTTP/1.1 connection, aborted when its client takes none of its bytes for
    ``send_timeout_s``: its write buffer stays above the transport's high-water mark that
    long. Aborted, not closed: ``close`` would keep the buffer until the client read it."""

    def __init__(self, *args: Any, send_timeout_s: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.send_timeout_s = send_timeout_s
        self._stalled: asyncio.TimerHandle | None = None

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stalled is None:
            self._stalled = self.loop.call_later(self.send_timeout_s, self.transport.abort)

    def resume_writing(self) -> None:
        self._taken()
        super().resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        self._taken()
        super().connection_lost(exc)

    def _taken(self) -> None:
        if self._stalled is not None:
            self._stalled.cancel()
            self._stalled = None


def run_status(coordinator: Coordinator) -> dict[str, Any]:
    snap = coordinator.snapshot(events_after=None)
    now = snap["now"]
    clients = [{"client_id": m["client_id"], "name": m["name"], "tier": m["tier"],
                "device": m["device_kind"], "tokens_per_second": m["tokens_per_second"],
                "last_seen_s_ago": max(now - m["last_seen"], 0.0), "relay": m["relay"],
                "bytes_up": m["bytes_up"], "bytes_down": m["bytes_down"]}
               for m in snap["members"]]
    return {"run_id": snap["run_id"], "phase": snap["phase"], "round": snap["round"],
            "tokens": snap["tokens"], "checkpoints": snap["checkpoints"], "clients": clients,
            "loss": {tier: [{"round": int(r), "loss": loss} for r, loss in points]
                     for tier, points in snap["loss"].items()},
            "bytes_received": {str(r["round"]): r["bytes_sent"] for r in snap["rounds"]},
            "bytes_dense": {str(r["round"]): r["bytes_dense"] for r in snap["rounds"]}}


def prometheus_text(snap: dict[str, Any]) -> str:
    """Counters (totals that only grow, named ``_total``) and gauges in the Prometheus
    exposition format (version 0.0.4), from a snapshot without history
    (``Coordinator.snapshot``: the last loss per tier is always in it)."""
    run = f'run="{snap["run_id"]}"'
    lines = [
        "# HELP matformer_rounds_total Rounds completed.",
        "# TYPE matformer_rounds_total counter",
        f"matformer_rounds_total{{{run}}} {snap['round']}",
        "# HELP matformer_tokens_total Tokens trained on.",
        "# TYPE matformer_tokens_total counter",
        f"matformer_tokens_total{{{run}}} {snap['tokens']}",
        "# HELP matformer_clients Members of the run.", "# TYPE matformer_clients gauge",
        f"matformer_clients{{{run}}} {len(snap['members'])}",
        "# HELP matformer_loss Mean training loss of the last completed round, per tier.",
        "# TYPE matformer_loss gauge",
    ]
    for tier, (_, loss) in sorted(snap["last_loss"].items()):
        lines.append(f'matformer_loss{{{run},tier="{tier}"}} {loss}')
    return "\n".join(lines) + "\n"
