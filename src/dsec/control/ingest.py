"""The heartbeat hot path, shared by the documented FastAPI route and a raw ASGI shortcut.

At thousands of beats per second the cost that matters is per request. FastAPI's routing, dependency
injection and two-step body handling (``json.loads`` then validation) cost several times more than the
work itself, so ``HeartbeatShortcut`` — a pure ASGI middleware — answers ``POST
/v1/workers/{id}/heartbeat`` directly: it reads the body, validates it in one pass
(``model_validate_json``, pydantic-core parsing JSON in Rust), and calls ``handle_heartbeat``, the same
function the FastAPI route calls. Behaviour, errors and metrics are identical on both paths (the bad-input
suite runs against the shortcut; ``Settings.heartbeat_shortcut=False`` routes through FastAPI).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import orjson
from pydantic import ValidationError

from dsec.control.auth import bearer
from dsec.control.errors import ApiError
from dsec.control.http import validation_details
from dsec.control.schemas import HeartbeatRequest

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

    from dsec.control.metrics import ControlPlaneMetrics
    from dsec.control.ports import HeartbeatEndpoint

PREFIX = "/v1/workers/"
SUFFIX = "/heartbeat"
ROUTE = "/v1/workers/{worker_id}/heartbeat"
_WORKER_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:-")


async def handle_heartbeat(
    cp: HeartbeatEndpoint, metrics: ControlPlaneMetrics, worker_id: str, authorization: str | None, body: bytes
) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) for one heartbeat request; never raises for bad input.

    The token is checked before the body is parsed: parsing costs more than the check, and only the worker itself
    may make the control plane spend it."""
    try:
        w = cp.worker_for(worker_id, bearer(authorization))
    except ApiError as exc:
        return exc.status, exc.body()
    try:
        req = HeartbeatRequest.model_validate_json(body)
    except ValidationError as exc:
        details = validation_details(exc.errors())
        message = "; ".join(f"{d['field']}: {d['message']}" for d in details[:5])
        return 422, {"error": "invalid", "message": message, "field": details[0]["field"], "details": details}
    try:
        answer = await cp.heartbeat(w, req)
    except ApiError as exc:
        return exc.status, exc.body()
    if not answer["duplicate"]:
        metrics.heartbeat_counter(w.pool).inc()
    return 200, answer


def match(path: str) -> str | None:
    """The worker id if ``path`` is a heartbeat path (``/v1/workers/<id>/heartbeat``), else None."""
    if not (path.startswith(PREFIX) and path.endswith(SUFFIX)):
        return None
    worker_id = path[len(PREFIX) : -len(SUFFIX)]
    if not 1 <= len(worker_id) <= 64 or not _WORKER_ID_CHARS.issuperset(worker_id):
        return None  # FastAPI answers it (404 / 422 naming worker_id)
    return worker_id


class HeartbeatShortcut:
    """Answers heartbeats without FastAPI; everything else passes through to ``app``."""

    def __init__(self, app: ASGIApp, cp: HeartbeatEndpoint, metrics: ControlPlaneMetrics, max_body_bytes: int) -> None:
        self.app = app
        self.cp = cp
        self.metrics = metrics
        self.max = max_body_bytes
        self._latency = metrics.latency.labels(ROUTE)
        self._by_status: dict[int, Any] = {}  # label children cached: labels() costs a lock and a dict build

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        worker_id = match(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if worker_id is None:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        authorization = None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"content-length" and value.isdigit() and int(value) > self.max:
                status, answer = 413, _too_large(self.max, value.decode())
                break
        else:
            body = await _read_body(receive, self.max)
            if body is None:
                status, answer = 413, _too_large(self.max, f"more than {self.max}")
            else:
                status, answer = await handle_heartbeat(self.cp, self.metrics, worker_id, authorization, body)
        payload = orjson.dumps(answer)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})
        counter = self._by_status.get(status)
        if counter is None:
            counter = self._by_status[status] = self.metrics.requests.labels(ROUTE, "POST", str(status))
        counter.inc()
        self._latency.observe(time.perf_counter() - start)


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _too_large(limit: int, size: str) -> dict[str, Any]:
    message = f"request body of {size} bytes exceeds the limit of {limit} bytes"
    return {"error": "too_large", "field": "body", "message": message, "details": []}
