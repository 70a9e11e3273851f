"""Routes for operators and their tools, without a token: liveness, readiness and the Prometheus exposition."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.responses import Response

from dsec import __version__
from dsec.control.deps import cp_of as _cp
from dsec.control.http import JSON

log = logging.getLogger(__name__)


class Readiness(BaseModel):
    """GET /readyz: ready (with counts) or unavailable (with a reason that names no host, path or SQL)."""

    status: str
    reason: str | None = None
    workers: int | None = None
    pools: int | None = None


def ops_routes() -> APIRouter:
    r = APIRouter(tags=["ops"])

    @r.get("/healthz")
    async def healthz() -> Response:
        """Liveness: the process answers."""
        return JSON({"status": "ok", "version": __version__})

    @r.get("/readyz", responses={503: {"model": Readiness, "description": "the store or the writer thread is down"}})
    async def readyz(request: Request) -> Response:
        """Readiness: the store answers and the writer thread is alive."""
        cp = _cp(request)
        try:
            await asyncio.to_thread(cp.store.list_pools)
        except Exception:
            # The store's error names hosts, paths and SQL; it goes to the log, not to whoever asks without a token.
            log.exception("readiness check: the store does not answer")
            return JSON({"status": "unavailable", "reason": "state store unavailable"}, status_code=503)
        if not cp.writer_alive():
            return JSON({"status": "unavailable", "reason": "writer thread stopped"}, status_code=503)
        return JSON({"status": "ready", "workers": len(cp.state.workers), "pools": len(cp.state.pools)})

    @r.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {CONTENT_TYPE_LATEST.split(";")[0]: {"schema": {"type": "string"}}}}},
    )
    async def metrics(request: Request) -> Response:
        """Prometheus text exposition (registry owned by this app)."""
        return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return r
