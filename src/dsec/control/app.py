"""``create_app(settings)``: the control plane as a FastAPI app. Routes are thin; behaviour lives in
``ControlPlane`` (service.py). Served by uvicorn (``dsec serve``) or embedded (``dsec demo``, tests).

This module wires the app: the store, the exception handlers, the middleware and the routers, one module per
resource (ops_routes.py, worker_routes.py, directive_routes.py, inventory_routes.py, event_routes.py,
report_routes.py, policy_routes.py, placement_routes.py, token_routes.py; healing.py, runtime_routes.py,
dashboard.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsec import __version__
from dsec.control.cluster import load_cluster
from dsec.control.cpu_thread import finer_switching
from dsec.control.dashboard import dashboard_routes
from dsec.control.deps import cp_of as _cp
from dsec.control.directive_routes import directive_routes
from dsec.control.errors import STATUS_REASONS, ApiError, ErrorBody
from dsec.control.event_routes import event_routes
from dsec.control.heal_routes import heal_routes
from dsec.control.healing import HealRegistry, epochs_from_store
from dsec.control.http import (
    BodyLimitAndMetrics,
    api_error_handler,
    http_exception_handler,
    model_error_handler,
    request_validation_handler,
    store_error_handler,
)
from dsec.control.ingest import HeartbeatShortcut
from dsec.control.inventory_routes import inventory_routes
from dsec.control.metrics import ControlPlaneMetrics
from dsec.control.ops_routes import ops_routes
from dsec.control.placement_routes import placement_routes
from dsec.control.policy_routes import policy_routes
from dsec.control.ratelimit import RateLimit, RateLimiter
from dsec.control.report_routes import report_routes
from dsec.control.runtime_routes import runtime_routes
from dsec.control.schemas import HeartbeatBatch, HeartbeatItem, HeartbeatRequest
from dsec.control.service import ControlPlane
from dsec.control.settings import Settings
from dsec.control.store import Store, StoreError, open_store
from dsec.control.token_routes import token_routes
from dsec.control.worker_routes import batch_routes, worker_routes
from dsec.fsutil import private_dir
from dsec.model import ModelError

__all__ = ["create_app", "load_cluster", "serve_target"]

log = logging.getLogger(__name__)


def create_app(settings: Settings, store: Store | None = None, clock: Callable[[], float] = time.time) -> FastAPI:
    """Build the app. Opens (and migrates) the store now, so a bad database URL fails here, loudly."""
    # The cluster file is checked before anything is opened: a typo in it starts nothing.
    cluster = load_cluster(settings.cluster_file) if settings.cluster_file is not None else None
    owned_store = store is None
    private_dir(settings.home)  # it holds the admin token and, for SQLite, the database: 0700 when created
    store = store or open_store(settings.database_url)
    cp = ControlPlane(settings, store, clock)
    if cluster is not None:
        cp.apply_cluster(*cluster)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Finer GIL switching for as long as it serves: the event loop answering a batch computes for ~20 ms at a
        # time, and the writer's commits waited behind it as they did behind the judgments (control/cpu_thread.py).
        with finer_switching():
            task = asyncio.create_task(_reconcile_forever(cp))
            try:
                yield
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                cp.close()
                if owned_store:
                    store.close()

    docs = {} if settings.api_docs else {"docs_url": None, "redoc_url": None}
    app = FastAPI(
        title="DSec control plane",
        version=__version__,
        lifespan=lifespan,
        description="Worker protocol and admin API; see docs/protocol.md.",
        **docs,  # type: ignore[arg-type]
    )
    app.state.cp = cp
    app.state.settings = settings
    app.state.metrics = ControlPlaneMetrics(cp.gauges, lambda: cp.cost.last)
    _add_error_handlers(app)
    _include_routers(app, cp, settings, clock)
    _add_middleware(app, cp, settings)
    _contract_openapi(app, HeartbeatRequest, HeartbeatBatch, HeartbeatItem)
    return app


def serve_target(app: FastAPI) -> Any:
    """The ASGI callable to hand to the server for an app made by ``create_app``."""
    return getattr(app.state, "asgi", app)


def _add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(RequestValidationError, request_validation_handler)
    app.add_exception_handler(StarletteHTTPException, http_exception_handler)
    app.add_exception_handler(ModelError, model_error_handler)
    app.add_exception_handler(StoreError, store_error_handler)


def _include_routers(app: FastAPI, cp: ControlPlane, settings: Settings, clock: Callable[[], float]) -> None:
    """Every resource's router, in the order requests are matched against them."""
    app.include_router(ops_routes())
    app.include_router(worker_routes())
    app.include_router(directive_routes())
    app.include_router(batch_routes())
    # The admin API (prefix /v1, tag admin): read routes for an admin or read token, admin routes for an admin token.
    for admin_api in (inventory_routes, event_routes, report_routes, policy_routes, placement_routes, token_routes):
        app.include_router(admin_api())
    app.state.heal = HealRegistry(
        cp.record_events,
        clock=clock,
        join_timeout_s=settings.heal_join_timeout_s,
        epochs=epochs_from_store(cp.store),
    )
    app.include_router(
        heal_routes(
            lambda request: request.app.state.heal,
            lambda request, token: (_cp(request).pool_of_token(token), _cp(request).is_admin(token)),
        )
    )
    app.include_router(runtime_routes())
    app.include_router(dashboard_routes())


def _add_middleware(app: FastAPI, cp: ControlPlane, settings: Settings) -> None:
    app.add_middleware(
        RateLimit, kind_of=cp.access.kind, limiter=RateLimiter(settings.rate_limit_per_s, settings.rate_limit_burst)
    )
    app.add_middleware(BodyLimitAndMetrics, max_body_bytes=settings.max_body_bytes, metrics=app.state.metrics)
    # What the server runs: the shortcut in front of the whole FastAPI app (its middleware stack included),
    # so a heartbeat costs one Python call chain instead of FastAPI's. See ``serve_target``.
    app.state.asgi = (
        HeartbeatShortcut(app, cp=cp, metrics=app.state.metrics, max_body_bytes=settings.max_body_bytes)
        if settings.heartbeat_shortcut
        else app
    )


def _contract_openapi(app: FastAPI, *models: type[BaseModel]) -> None:
    """The OpenAPI document as the server answers: ``models`` added to the components (routes that read their body
    themselves), and on every operation the error statuses no route can forget: 422 (FastAPI lists it for any route
    with input) carries our error body instead of FastAPI's, and a route with a body answers 413 over the cap."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = original()
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            every: tuple[type[BaseModel], ...] = (*models, ErrorBody)
            for model in every:
                defs = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(defs.pop("$defs", {}))
                components[model.__name__] = defs
            for operations in schema.get("paths", {}).values():
                for op in operations.values():
                    _error_statuses(op)
            for unused in ("HTTPValidationError", "ValidationError"):
                components.pop(unused, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def _error_statuses(op: dict[str, Any]) -> None:
    responses = op.setdefault("responses", {})
    body = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    if "422" in responses:
        responses["422"] = {"description": STATUS_REASONS[422], "content": body}
    if "requestBody" in op:
        responses.setdefault("413", {"description": STATUS_REASONS[413], "content": body})


async def _reconcile_forever(cp: ControlPlane) -> None:
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + cp.settings.reconcile_interval_s
        await asyncio.sleep(cp.settings.reconcile_interval_s)
        # Waking late means the loop (or the process) stalled: beats may be waiting unread (Reconciler._mark_lost).
        stall_s = max(0.0, loop.time() - due)
        try:
            await cp.reconcile(stall_s)
        except Exception:  # the loop must survive a store outage; the next pass retries
            log.exception("reconcile pass failed")
        await cp.cost.refresh()  # at most every cost_refresh_s; it logs its own failures
