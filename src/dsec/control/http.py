"""ASGI plumbing around the API: JSON responses, error rendering, body-size limit, request metrics.

Pure ASGI middleware (not BaseHTTPMiddleware): it adds a few microseconds per request instead of a
task and a stream copy, which matters at 10k heartbeats/s.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Sequence
from typing import Any, cast

import orjson
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dsec.control.errors import ApiError
from dsec.control.metrics import ControlPlaneMetrics

log = logging.getLogger(__name__)


class JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)


def _loc_to_field(loc: tuple[Any, ...] | list[Any]) -> str:
    # FastAPI prefixes a location with its source; only that first part is not a field name.
    parts = list(loc)
    if parts and parts[0] in ("body", "query", "path", "header", "cookie"):
        parts = parts[1:]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "body"


def validation_details(errors: Sequence[Any]) -> list[dict[str, Any]]:
    """pydantic errors -> [{"field", "message", "type"}], fields as dotted paths without the source prefix."""
    details = []
    for err in errors:
        field = _loc_to_field(err.get("loc", ()))
        msg = err.get("msg", "invalid")
        if err.get("type") == "json_invalid":
            field = "body"
            msg = f"malformed JSON: {err.get('ctx', {}).get('error', msg)}"
        details.append({"field": field, "message": msg, "type": err.get("type")})
    return details or [{"field": "body", "message": "invalid request", "type": None}]


def validation_error_response(exc: RequestValidationError) -> JSON:
    details = validation_details(exc.errors())
    message = "; ".join(f"{d['field']}: {d['message']}" for d in details[:5])
    return JSON(
        {"error": "invalid", "message": message, "field": details[0]["field"], "details": details}, status_code=422
    )


async def api_error_handler(_request: Request, exc: Exception) -> Response:
    err = cast(ApiError, exc)  # registered for ApiError only
    return JSON(err.body(), status_code=err.status)


async def http_exception_handler(request: Request, exc: Exception) -> Response:
    """Starlette/FastAPI's own HTTP errors (unknown route, wrong method, unparsable body) in our shape."""
    err = cast(StarletteHTTPException, exc)
    status, detail = err.status_code, str(err.detail)
    headers = dict(getattr(err, "headers", None) or {})
    if status == 400 and "parsing the body" in detail:
        # A body that is not UTF-8 JSON is malformed JSON: the documented 422 naming the body, not an undocumented 400.
        status, detail = 422, "request body could not be parsed (it must be UTF-8 JSON)"
    elif status == 405:
        # Starlette's Allow names the methods of the one route it matched; a path served by several routes (GET and
        # PUT /v1/pools/{name}) must list them all (RFC 9110 section 15.5.6): those the OpenAPI document gives it.
        allowed = allowed_methods(request.app.openapi(), request.url.path)
        if allowed:
            headers["Allow"] = ", ".join(allowed)
    codes = {404: "not_found", 405: "method_not_allowed", 422: "invalid"}
    body: dict[str, Any] = {
        "error": codes.get(status, "http_error"),
        "message": detail,
        "field": "body" if status == 422 else None,
        "details": [],
    }
    return JSON(body, status_code=status, headers=headers or None)


def allowed_methods(openapi: dict[str, Any], path: str) -> list[str]:
    """The methods the document lists for the path templates ``path`` matches. From the document, not the router:
    FastAPI's included routers are internal structures, and the document is the contract the header states."""
    matching = [(t, ops) for t, ops in openapi.get("paths", {}).items() if _template_regex(t).match(path)]
    if not matching:
        return []
    # The most specific templates name the resource: /v1/workers/register, not /v1/workers/{worker_id}.
    fewest = min(t.count("{") for t, _ in matching)
    return sorted({m.upper() for t, ops in matching if t.count("{") == fewest for m in ops if m in _HTTP_METHODS})


_HTTP_METHODS = frozenset({"get", "put", "post", "delete", "patch", "head", "options", "trace"})


@functools.lru_cache(maxsize=1024)
def _template_regex(template: str) -> re.Pattern[str]:
    return compile_path(template)[0]


async def store_error_handler(_request: Request, exc: Exception) -> Response:
    """A store that fails under a route (a read the writer does not guard): the documented 503, not a 500. The
    store's error names hosts, paths and SQL: it goes to the log, not to the caller."""
    log.error("state store error under a request: %s", exc)
    body: dict[str, Any] = {
        "error": "unavailable",
        "message": "state store unavailable, retry later",
        "field": None,
        "details": [],
    }
    return JSON(body, status_code=503)


async def model_error_handler(_request: Request, exc: Exception) -> Response:
    """A domain value rejected by ``dsec.model`` (its message starts with ``field=value``)."""
    message = str(exc)
    field = message.split("=", 1)[0].split(" ", 1)[0] if "=" in message else None
    return JSON({"error": "invalid", "message": message, "field": field, "details": []}, status_code=422)


async def request_validation_handler(_request: Request, exc: Exception) -> Response:
    return validation_error_response(cast(RequestValidationError, exc))


class BodyLimitAndMetrics:
    """Rejects bodies over ``max_body_bytes`` with 413 (by Content-Length, or while streaming) and
    records request count and latency by route template."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, metrics: ControlPlaneMetrics) -> None:
        self.app = app
        self.max = max_body_bytes
        self.metrics = metrics

    async def _reject(self, send: Send, size: str) -> None:
        body = orjson.dumps(
            {
                "error": "too_large",
                "field": "body",
                "message": f"request body of {size} bytes exceeds the limit of {self.max} bytes",
                "details": [],
            }
        )
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max:
                    await self._reject(send, str(declared))
                    self._observe(scope, 413, start)
                    return
                break

        else:
            # No Content-Length (chunked upload): buffer up to the limit, then replay to the app.
            if scope.get("method") in ("POST", "PUT", "PATCH"):
                chunks, size = [], 0
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        break
                    size += len(message.get("body", b""))
                    if size > self.max:
                        await self._reject(send, f"more than {self.max}")
                        self._observe(scope, 413, start)
                        return
                    chunks.append(message.get("body", b""))
                    if not message.get("more_body", False):
                        break
                receive = _replay(b"".join(chunks), receive)

        async def tracking_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            self._observe(scope, status, start)

    def _observe(self, scope: Scope, status: int, start: float) -> None:
        route = scope.get("route")
        template = getattr(route, "path", None) or "unmatched"
        self.metrics.requests.labels(template, scope.get("method", ""), str(status)).inc()
        self.metrics.latency.labels(template).observe(time.perf_counter() - start)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive callable that yields the already-read ``body`` once, then defers to ``receive``."""
    replayed = False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
