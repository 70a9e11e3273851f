"""The web dashboard at ``/``: one HTML page, a script and a style sheet shipped as package data (src/dsec/dashboard/),
no build step. The page reads only the existing read API (``GET /v1/status``, ``/v1/events`` with its cursor,
``/v1/devices``, ``/v1/policies``) with a read-only token the operator gives it, and ``GET /metrics`` for the four
headline gauges exactly as Prometheus sees them. Nothing here knows a token: the HTML is the same for everyone and
holds no secret.

The simulator's latest plots (``dsec simulate`` publishes them, see dsec.plots) are listed at ``/dashboard/plots``
and served at ``/dashboard/plots/<name>``, both with a read token like the rest of the page's data (the page fetches
them with its token and shows them from memory). Only the names dsec.plots knows are served, from the plots
directory (``Settings.plots``), never a path: a name with a slash or ``..`` is refused (400), any other unknown name
or a plot not published is 404.

These routes are not part of the API contract (``include_in_schema=False``): they answer files, not JSON.
"""

from __future__ import annotations

import asyncio
from importlib import resources

from fastapi import APIRouter, Request
from starlette.responses import Response

from dsec import plots
from dsec.control import errors
from dsec.control.auth import bearer
from dsec.control.deps import Auth, cp_of
from dsec.control.http import JSON

# Same-origin only: the page loads its own script and style and talks to its own server; no inline script, no frames.
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; connect-src 'self'; "
        "base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}
ASSETS = {
    "app.js": "text/javascript; charset=utf-8",
    "plots.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# A plot opened on its own: an image, nothing in it may run or load anything (an SVG is a document).
PLOT_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; sandbox",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _asset(name: str) -> bytes:
    return (resources.files("dsec") / "dashboard" / name).read_bytes()


def dashboard_routes() -> APIRouter:
    r = APIRouter(include_in_schema=False)

    @r.get("/")
    async def index() -> Response:
        return Response(_asset("index.html"), media_type="text/html; charset=utf-8", headers=SECURITY_HEADERS)

    @r.get("/dashboard/plots")
    async def plot_index(request: Request, authorization: Auth = None) -> Response:
        cp_of(request).require_read(bearer(authorization))
        listing = await asyncio.to_thread(plots.latest, request.app.state.settings.plots)  # disk: off the loop
        return JSON(listing, headers={"Cache-Control": "no-cache"})

    @r.get("/dashboard/plots/{name:path}")
    async def plot(name: str, request: Request, authorization: Auth = None) -> Response:
        cp_of(request).require_read(bearer(authorization))
        if "/" in name or "\\" in name or ".." in name:
            raise errors.ApiError(400, "invalid", f"name {name!r} is invalid: a plot is named, not a path", "name")
        found = await asyncio.to_thread(plots.read, request.app.state.settings.plots, name)
        if found is None:
            known = ", ".join(plots.PLOTS)
            why = f"name {name!r}: no such plot published (plots: {known}; `dsec simulate` publishes them)"
            raise errors.ApiError(404, "not_found", why, "name")
        data, media = found
        return Response(data, media_type=media, headers=PLOT_HEADERS)

    @r.get("/dashboard/{name}")
    async def asset(name: str) -> Response:
        media = ASSETS.get(name)
        if media is None:
            raise errors.not_found("dashboard file", name, "name")
        return Response(_asset(name), media_type=media, headers=SECURITY_HEADERS)

    return r
