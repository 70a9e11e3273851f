"""The heartbeat hot path, shared by the documented FastAPI route and a raw ASGI shortcut.

At thousands of beats per second the cost that matters is per request. FastAPI's routing, dependency
injection and two-step body handling (``json.loads`` then validation) cost several times more than the
work itself, so ``HeartbeatShortcut`` — a pure ASGI middleware — answers ``POST
/v1/workers/{id}/heartbeat`` directly: it reads the body, validates it in one pass
(``model_validate_json``, pydantic-core parsing JSON in Rust), and calls ``handle_heartbeat``, the same
function the FastAPI route calls. Behaviour, errors and metrics are identical on both paths (the bad-input
suite runs against the shortcut; ``Settings.heartbeat_shortcut=False`` routes through FastAPI).

``POST /v1/heartbeats`` (``handle_batch``) carries many workers' beats in one request — what a node agent
(``dsec.agent``) sends — and applies each item through the same steps as a single beat (``authenticate``,
``validate``, ``apply_beat``), one item's failure never touching the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

import orjson
import pydantic_core
from pydantic import ValidationError

from dsec import pacing
from dsec.control.auth import bearer
from dsec.control.errors import ApiError
from dsec.control.http import validation_details
from dsec.control.schemas import MAX_BATCH_ITEMS, Beat, HeartbeatRequest, plain_beat
from dsec.control.store import StoreError

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

    from dsec.control.metrics import ControlPlaneMetrics
    from dsec.control.ports import HeartbeatEndpoint
    from dsec.control.state import LiveWorker

log = logging.getLogger(__name__)

PREFIX = "/v1/workers/"
SUFFIX = "/heartbeat"
ROUTE = "/v1/workers/{worker_id}/heartbeat"
BATCH_ROUTE = "/v1/heartbeats"
_WORKER_ID_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:-")


async def handle_heartbeat(
    cp: HeartbeatEndpoint, metrics: ControlPlaneMetrics, worker_id: str, authorization: str | None, body: bytes
) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) for one heartbeat request; never raises for bad input.

    The token is checked before the body is parsed: parsing costs more than the check, and only the worker itself
    may make the control plane spend it. While it is answered, the judgments' thread gives way (dsec/pacing.py)."""
    with pacing.request():
        return await _heartbeat(cp, metrics, worker_id, authorization, body)


async def _heartbeat(
    cp: HeartbeatEndpoint, metrics: ControlPlaneMetrics, worker_id: str, authorization: str | None, body: bytes
) -> tuple[int, dict[str, Any]]:
    try:
        w = cp.worker_for(worker_id, bearer(authorization))
    except ApiError as exc:
        return exc.status, exc.body()
    try:
        req = HeartbeatRequest.model_validate_json(body)
    except ValidationError as exc:
        return 422, invalid(exc)
    return await apply_beat(cp, metrics, w, req)


def invalid(exc: ValidationError) -> dict[str, Any]:
    """The 422 body for a beat that does not validate (every problem in ``details``, the first one named)."""
    details = validation_details(exc.errors())
    message = "; ".join(f"{d['field']}: {d['message']}" for d in details[:5])
    return {"error": "invalid", "message": message, "field": details[0]["field"], "details": details}


async def apply_beat(
    cp: HeartbeatEndpoint, metrics: ControlPlaneMetrics, w: LiveWorker, req: Beat
) -> tuple[int, dict[str, Any]]:
    """Apply one validated beat of an authenticated worker: (200, answer) or (status, error body)."""
    try:
        answer = await cp.heartbeat(w, req)
    except ApiError as exc:
        return exc.status, exc.body()
    if not answer["duplicate"]:
        metrics.heartbeat_counter(w.pool).inc()
    return 200, answer


# -- many workers' beats in one request ----------------------------------------------------------------------------
def _batch_invalid(message: str, field: str) -> dict[str, Any]:
    return {"error": "invalid", "message": message, "field": field, "details": [{"field": field, "message": message}]}


async def handle_batch(
    cp: HeartbeatEndpoint, metrics: ControlPlaneMetrics, authorization: str | None, body: bytes
) -> tuple[int, dict[str, Any]]:
    """(status, JSON body) for ``POST /v1/heartbeats``; never raises for bad input.

    The request's token (an admin token, or a token of a worker the control plane knows: a node agent sends one of
    the batch's own) is checked before the body is parsed. Then each item goes through what a single beat goes
    through — its own token against its ``worker_id`` first, then its fields, then the beat itself — and gets its
    own result: the single-beat answer with ``status`` 200, or that route's error body with ``status`` and ``index``.
    One bad item never fails the others. Items whose beat must be committed (events, a new directive) wait for
    the group commit together, not one after the other. While it is answered, the judgments' thread gives way
    (dsec/pacing.py): a batch is ~20 ms of pure Python at 500 items, which a pass sharing the GIL made twice as long."""
    with pacing.request():
        return await _batch(cp, metrics, authorization, body)


async def _batch(
    cp: HeartbeatEndpoint, metrics: ControlPlaneMetrics, authorization: str | None, body: bytes
) -> tuple[int, dict[str, Any]]:
    try:
        cp.batch_sender(bearer(authorization))
    except ApiError as exc:
        return exc.status, exc.body()
    try:
        doc = pydantic_core.from_json(body)  # NaN is kept here and refused per item, by the item's own validation
    except ValueError as exc:
        return 422, _batch_invalid(f"malformed JSON: {exc}", "body")
    if not isinstance(doc, dict):
        return 422, _batch_invalid('the body must be a JSON object {"items": [...]}', "body")
    extra = sorted(str(k) for k in doc if k != "items")
    if extra:
        return 422, _batch_invalid(f"{extra[0]}: Extra inputs are not permitted (a batch has only items)", extra[0])
    items = doc.get("items")
    if not isinstance(items, list):
        what = "missing" if items is None and "items" not in doc else "not an array"
        return 422, _batch_invalid(f"items: {what}; expected an array of heartbeat items", "items")
    if len(items) > MAX_BATCH_ITEMS:
        return 422, _batch_invalid(
            f"items: {len(items)} items; a batch carries at most {MAX_BATCH_ITEMS} (MAX_BATCH_ITEMS): split it",
            "items",
        )
    results: list[dict[str, Any] | None] = [None] * len(items)
    waiting: list[tuple[int, asyncio.Future[dict[str, Any]]]] = []
    with cp.commits_together():  # the items' durable writes (beats with events): one transaction, not one each
        for i, item in enumerate(items):
            done, result, rest = _start(_batch_item(cp, metrics, i, item))
            if done:
                results[i] = result
            else:
                assert rest is not None
                waiting.append((i, rest))
    if waiting:
        finished = await asyncio.gather(*(f for _, f in waiting))
        for (i, _), result in zip(waiting, finished, strict=True):
            results[i] = result
    return 200, {"items": results}


async def _batch_item(cp: HeartbeatEndpoint, metrics: ControlPlaneMetrics, index: int, item: Any) -> dict[str, Any]:
    status, answer = await _one_item(cp, metrics, item)
    if status == 200:
        answer["status"] = 200
        return answer
    return {"status": status, "index": index, **answer}


async def _one_item(cp: HeartbeatEndpoint, metrics: ControlPlaneMetrics, item: Any) -> tuple[int, dict[str, Any]]:
    if not isinstance(item, dict):
        return 422, _batch_invalid("an item must be a JSON object (a heartbeat item)", "item")
    worker_id, token = item.pop("worker_id", None), item.pop("token", None)
    if not isinstance(token, str) or not token:
        # What a single beat without a token answers: 401, naming where the token goes.
        return 401, {**_batch_invalid("token: required, the worker's own token", "token"), "error": "unauthorized"}
    if len(token) > 256:  # HeartbeatItem's bound: no token is that long
        return 422, _batch_invalid("token: at most 256 characters", "token")
    if not isinstance(worker_id, str) or not worker_id:
        return 422, _batch_invalid("worker_id: required, a non-empty string", "worker_id")
    if not worker_id_ok(worker_id):  # what match() answers for the item's heartbeat path
        return 422, _batch_invalid(f"worker_id {worker_id[:80]!r}: expected 1-64 of A-Z a-z 0-9 _ . : -", "worker_id")
    try:
        w = cp.worker_for(worker_id, token)  # the item's own token, before its fields are looked at
        req: Beat | None = plain_beat(item)
        if req is None:
            try:
                req = HeartbeatRequest.model_validate(item)
            except ValidationError as exc:
                return 422, invalid(exc)
        return await apply_beat(cp, metrics, w, req)
    except ApiError as exc:
        return exc.status, exc.body()
    except StoreError:
        log.exception("batch item: the state store failed")
        return 503, {"error": "unavailable", "message": "state store unavailable, retry later", "field": None,
                     "details": []}  # fmt: skip
    except Exception:  # a bug must cost this item, not the batch (and never the other workers' beats)
        log.exception("batch item %r failed", worker_id)
        return 503, {"error": "unavailable", "message": "this beat could not be applied; retry", "field": None,
                     "details": []}  # fmt: skip


def _start(
    coro: Coroutine[Any, Any, dict[str, Any]],
) -> tuple[bool, dict[str, Any] | None, asyncio.Future[dict[str, Any]] | None]:
    """Run ``coro`` now, up to its first wait: ``(True, result, None)`` when it finished without waiting (a beat
    without events: the common case), else ``(False, None, future)`` with the rest scheduled as a task.

    What ``asyncio.eager_task_factory`` does from Python 3.12: most items of a batch never wait, and a task per item
    would cost a loop iteration each; the few that wait for the group commit wait for it together."""
    try:
        yielded = coro.send(None)
    except StopIteration as stop:
        return True, stop.value, None
    return False, None, asyncio.ensure_future(_resume(coro, yielded))


async def _resume(coro: Coroutine[Any, Any, dict[str, Any]], yielded: Any) -> dict[str, Any]:
    """Drive a coroutine started by ``_start`` to its end, as a Task would: wait for what it waits for, then resume
    it (the awaited future hands the coroutine its own result or exception); a cancellation is passed into it."""
    while True:
        try:
            if yielded is None:  # a bare yield (asyncio.sleep(0))
                await asyncio.sleep(0)
            else:
                yielded._asyncio_future_blocking = False
                await asyncio.wait((yielded,))
        except BaseException as exc:  # cancelled while waiting: the coroutine decides what that means
            try:
                yielded = coro.throw(exc)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            continue
        try:
            yielded = coro.send(None)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]


def match(path: str) -> str | None:
    """The worker id if ``path`` is a heartbeat path (``/v1/workers/<id>/heartbeat``), else None."""
    if not (path.startswith(PREFIX) and path.endswith(SUFFIX)):
        return None
    worker_id = path[len(PREFIX) : -len(SUFFIX)]
    if not worker_id_ok(worker_id):
        return None  # FastAPI answers it (404 / 422 naming worker_id)
    return worker_id


def worker_id_ok(worker_id: str) -> bool:
    """Whether ``worker_id`` may be a worker id (``match`` of its heartbeat path is not None): 1-64 of A-Z a-z 0-9
    _ . : -. A batch item checks its id with this, not by building the path for ``match`` (once per item)."""
    return 1 <= len(worker_id) <= 64 and _WORKER_ID_CHARS.issuperset(worker_id)


class HeartbeatShortcut:
    """Answers heartbeats (single and batched) without FastAPI; everything else passes through to ``app``."""

    def __init__(self, app: ASGIApp, cp: HeartbeatEndpoint, metrics: ControlPlaneMetrics, max_body_bytes: int) -> None:
        self.app = app
        self.cp = cp
        self.metrics = metrics
        self.max = max_body_bytes
        self._latency = metrics.latency.labels(ROUTE)
        self._batch_latency = metrics.latency.labels(BATCH_ROUTE)
        # label children cached: labels() costs a lock and a dict build
        self._by_status: dict[tuple[str, int], Any] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        worker_id = None
        if scope["type"] == "http" and scope["method"] == "POST":
            worker_id = "" if scope["path"] == BATCH_ROUTE else match(scope["path"])
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
            body = await read_body(receive, self.max)
            if body is None:
                status, answer = 413, _too_large(self.max, f"more than {self.max}")
            elif worker_id:
                status, answer = await handle_heartbeat(self.cp, self.metrics, worker_id, authorization, body)
            else:
                status, answer = await handle_batch(self.cp, self.metrics, authorization, body)
        payload = orjson.dumps(answer)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": payload})
        route = ROUTE if worker_id else BATCH_ROUTE
        counter = self._by_status.get((route, status))
        if counter is None:
            counter = self._by_status[(route, status)] = self.metrics.requests.labels(route, "POST", str(status))
        counter.inc()
        (self._latency if worker_id else self._batch_latency).observe(time.perf_counter() - start)


async def read_body(receive: Receive, limit: int) -> bytes | None:
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
