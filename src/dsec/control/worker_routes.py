"""Routes of the worker protocol (docs/protocol.md): register, heartbeat, deregister, the worker listings, and the
batched heartbeats of a node agent. A worker's directive has its own routes (directive_routes.py)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from dsec.control.auth import bearer
from dsec.control.deps import Auth, WorkerId
from dsec.control.deps import cp_of as _cp
from dsec.control.errors import documented
from dsec.control.http import JSON
from dsec.control.ingest import handle_batch, handle_heartbeat
from dsec.control.schemas import HeartbeatBatchAnswer, RegisterRequest
from dsec.model import WorkerState


def _body_schema(model: str) -> dict[str, Any]:
    """``openapi_extra`` of a route that reads its body itself: the body is required and is a ``model``."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}},
        }
    }


def worker_routes() -> APIRouter:
    # Every route here checks a token and is rate limited (heartbeats: by their event budget); what else a route can
    # answer is on the route. 422 and 413 are added to every route with input by _contract_openapi.
    r = APIRouter(prefix="/v1/workers", tags=["workers"], responses=documented(401, 403, 429))

    @r.post("/register", status_code=201, responses=documented(404, 503))
    async def register(body: RegisterRequest, request: Request, authorization: Auth = None) -> Response:
        """Register a worker with a pool token; answers its id, its own token and its first directive."""
        return JSON(await _cp(request).register(body, bearer(authorization)), status_code=201)

    @r.post(
        "/{worker_id}/heartbeat", responses=documented(404, 409, 503), openapi_extra=_body_schema("HeartbeatRequest")
    )
    async def heartbeat(worker_id: WorkerId, request: Request, authorization: Auth = None) -> Response:
        """Report a batch of metric summaries and events; answers the directive when its version changed.

        Normally answered by the ASGI shortcut in ingest.py before FastAPI routing; same handler."""
        status, answer = await handle_heartbeat(
            _cp(request), request.app.state.metrics, worker_id, authorization, await request.body()
        )
        return JSON(answer, status_code=status)

    @r.post("/{worker_id}/deregister", responses=documented(404, 503))
    async def deregister(
        worker_id: WorkerId,
        request: Request,
        authorization: Auth = None,
        reason: Annotated[str, Query(max_length=200)] = "exit",
    ) -> Response:
        cp = _cp(request)
        return JSON(await cp.deregister(cp.worker_for(worker_id, bearer(authorization)), reason))

    @r.get("")
    async def list_workers(
        request: Request,
        authorization: Auth = None,
        pool: Annotated[str | None, Query(max_length=128)] = None,
        state: WorkerState | None = None,
    ) -> Response:
        cp = _cp(request)
        cp.require_read(bearer(authorization))
        ws = [
            cp.worker_api(w)
            for w in cp.state.workers.values()
            if (pool is None or w.pool == pool) and (state is None or w.state is state)
        ]
        ws.sort(key=lambda w: (w["pool"], w["group"], w["rank"], w["id"]))
        return JSON({"items": ws})

    @r.get("/{worker_id}", responses=documented(404))
    async def get_worker(worker_id: WorkerId, request: Request, authorization: Auth = None) -> Response:
        cp = _cp(request)
        cp.require_read(bearer(authorization))
        return JSON(cp.worker_api(cp.worker_for(worker_id, bearer(authorization), read=True)))

    return r


def batch_routes() -> APIRouter:
    r = APIRouter(prefix="/v1", tags=["workers"], responses=documented(401, 403))

    @r.post("/heartbeats", response_model=HeartbeatBatchAnswer, openapi_extra=_body_schema("HeartbeatBatch"))
    async def heartbeats(request: Request, authorization: Auth = None) -> Response:
        """Many workers' heartbeats in one request (a node agent's, `dsec agent`): each item is a single beat's body
        plus ``worker_id`` and that worker's own ``token``. Sent with an admin token or the token of a worker the
        control plane knows (one of the batch's own). Answers one result per item, in order: the single-beat answer
        with ``status`` 200, or that route's error body with its ``status`` and the item's ``index``; one bad item
        never fails the others. More than 1000 items (MAX_BATCH_ITEMS) is a 422 naming ``items``.

        Normally answered by the ASGI shortcut in ingest.py before FastAPI routing; same handler."""
        status, answer = await handle_batch(
            _cp(request), request.app.state.metrics, authorization, await request.body()
        )
        return JSON(answer, status_code=status)

    return r
