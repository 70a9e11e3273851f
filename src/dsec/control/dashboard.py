"""The web dashboard at ``/``: one HTML page, a script and a style sheet shipped as package data (src/dsec/dashboard/),
no build step. The page reads only the existing read API (``GET /v1/status``, ``/v1/events`` with its cursor,
``/v1/devices``, ``/v1/policies``) with a read-only token the operator gives it, and ``GET /metrics`` for the four
headline gauges exactly as Prometheus sees them. Nothing here knows a token: the HTML is the same for everyone and
holds no secret.

These routes are not part of the API contract (``include_in_schema=False``): they answer files, not JSON.
"""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from starlette.responses import Response

from dsec.control import errors

# Same-origin only: the page loads its own script and style and talks to its own server; no inline script, no frames.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
        "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}
ASSETS = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}


def _asset(name: str) -> bytes:
    return (resources.files("dsec") / "dashboard" / name).read_bytes()


def dashboard_routes() -> APIRouter:
    r = APIRouter(include_in_schema=False)

    @r.get("/")
    async def index() -> Response:
        return Response(_asset("index.html"), media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)

    @r.get("/dashboard/{name}")
    async def asset(name: str) -> Response:
        media = ASSETS.get(name)
        if media is None:
            raise errors.not_found("dashboard file", name, "name")
        return Response(_asset(name), media_type=media, headers=SECURITY_HEADERS)

    return r
