"""``create_app(settings)``: the control plane as a FastAPI app. Routes are thin; behaviour lives in
``ControlPlane`` (service.py). Served by uvicorn (``dsec serve``) or embedded (``dsec demo``, tests)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from dsec import __version__
from dsec.control import auth, errors
from dsec.control.auth import bearer
from dsec.control.dashboard import dashboard_routes
from dsec.control.deps import ADMIN_ONLY, Auth, PoolName, TokenId, WorkerId
from dsec.control.deps import cp_of as _cp
from dsec.control.errors import STATUS_REASONS, ApiError, ErrorBody, documented
from dsec.control.healing import HealRegistry, epochs_from_store, heal_routes
from dsec.control.http import (
    JSON,
    BodyLimitAndMetrics,
    api_error_handler,
    http_exception_handler,
    model_error_handler,
    request_validation_handler,
    store_error_handler,
)
from dsec.control.ingest import HeartbeatShortcut, handle_batch, handle_heartbeat
from dsec.control.metrics import ControlPlaneMetrics
from dsec.control.ratelimit import RateLimit, RateLimiter
from dsec.control.runtime_routes import runtime_routes
from dsec.control.schemas import (
    ClusterSpec,
    DeviceSpec,
    DirectivePatch,
    EventRecord,
    HeartbeatBatch,
    HeartbeatBatchAnswer,
    HeartbeatItem,
    HeartbeatRequest,
    PlacementRequest,
    PolicyUpload,
    PoolUpdate,
    RegisterRequest,
    TokenCreate,
)
from dsec.control.service import ControlPlane
from dsec.control.settings import Settings
from dsec.control.store import EventQuery, Store, StoreError, open_store
from dsec.cost import Window, WindowError
from dsec.fsutil import private_dir
from dsec.model import Device, DeviceHealth, Event, EventType, ModelError, Pool, PoolThresholds, WorkerState
from dsec.scheduler.placement import job_from_dict
from dsec.yamlconf import ConfigError, load_file

log = logging.getLogger(__name__)


def pool_from_spec(name: str, spec: Any) -> Pool:
    return Pool(
        name=name,
        devices=tuple(spec.devices),
        thresholds=PoolThresholds(spec.thresholds.bandwidth_cap_mbps, spec.thresholds.latency_cap_ms),
        memory_base_gb=spec.memory_base_gb,
        memory_ceiling_gb=spec.memory_ceiling_gb,
        snapshot_interval_s=spec.snapshot_interval_s,
        snapshot_compression_level=spec.snapshot_compression_level,
        gpu_quota=spec.gpu_quota,
    )


def device_from_spec(spec: DeviceSpec) -> Device:
    return Device(
        id=spec.id,
        node=spec.node,
        model=spec.model,
        memory_gb=spec.memory_gb,
        numa_node=spec.numa_node,
        nvlink_peers=tuple(spec.nvlink_peers),
        health=DeviceHealth(spec.health),
        pool=spec.pool,
    )


def load_cluster(path: Any) -> tuple[list[Pool], list[Device]]:
    spec = load_file(ClusterSpec, path)
    return [pool_from_spec(p.name, p) for p in spec.pools], [device_from_spec(d) for d in spec.devices]


def worker_routes() -> APIRouter:
    # Every route here checks a token and is rate limited (heartbeats: by their event budget); what else a route can
    # answer is on the route. 422 and 413 are added to every route with input by _contract_openapi.
    r = APIRouter(prefix="/v1/workers", tags=["workers"], responses=documented(401, 403, 429))
    admin = APIRouter(dependencies=ADMIN_ONLY)  # admin token checked before anything else

    @r.post("/register", status_code=201, responses=documented(404, 503))
    async def register(body: RegisterRequest, request: Request, authorization: Auth = None) -> Response:
        """Register a worker with a pool token; answers its id, its own token and its first directive."""
        return JSON(await _cp(request).register(body, bearer(authorization)), status_code=201)

    @r.post(
        "/{worker_id}/heartbeat",
        responses=documented(404, 409, 503),
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/HeartbeatRequest"}}},
            }
        },
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

    @r.get("/{worker_id}/directive", responses=documented(404))
    async def get_directive(worker_id: WorkerId, request: Request, authorization: Auth = None) -> Response:
        """Desired vs acked directive of one worker (the worker itself may read it too)."""
        cp = _cp(request)
        return JSON(cp.directive_api(cp.worker_for(worker_id, bearer(authorization), read=True)))

    @admin.patch("/{worker_id}/directive", responses=documented(404, 409, 503))
    async def patch_directive(
        worker_id: WorkerId, body: DirectivePatch, request: Request, authorization: Auth = None
    ) -> Response:
        """Change directive fields; the version goes up by one and the worker gets it on its next beat."""
        cp = _cp(request)
        w = cp.worker_for(worker_id, bearer(authorization))
        patch = body.model_dump(exclude_unset=True)
        if not patch:
            raise ApiError(422, "invalid", "empty patch: give at least one directive field", "body")
        await cp.set_directive(w, patch, actor="api")
        return JSON(cp.directive_api(w))

    r.include_router(admin)
    return r


def batch_routes() -> APIRouter:
    r = APIRouter(prefix="/v1", tags=["workers"], responses=documented(401, 403))

    @r.post(
        "/heartbeats",
        response_model=HeartbeatBatchAnswer,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/HeartbeatBatch"}}},
            }
        },
    )
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


def admin_routes() -> APIRouter:
    r = APIRouter(prefix="/v1", tags=["admin"], responses=documented(401, 403, 429))  # read routes: admin or read token
    # admin token checked before anything else; every admin route writes to (or reads) the store: 503 when it fails
    admin = APIRouter(dependencies=ADMIN_ONLY, responses=documented(503))

    @r.get("/pools")
    async def list_pools(request: Request, authorization: Auth = None) -> Response:
        cp = _cp(request)
        cp.require_read(bearer(authorization))
        return JSON({"items": [p.to_dict() for p in sorted(cp.state.pools.values(), key=lambda p: p.name)]})

    @r.get("/pools/{name}", responses=documented(404))
    async def get_pool(name: PoolName, request: Request, authorization: Auth = None) -> Response:
        cp = _cp(request)
        cp.require_read(bearer(authorization))
        pool = cp.state.pools.get(name)
        if pool is None:
            raise errors.not_found("pool", name, "name")
        return JSON(pool.to_dict())

    @admin.put("/pools/{name}")
    async def put_pool(name: PoolName, body: PoolUpdate, request: Request) -> Response:
        """Create or replace a pool."""
        cp = _cp(request)
        return JSON((await cp.put_pool(pool_from_spec(name, body))).to_dict())

    @admin.delete("/pools/{name}", status_code=204, responses=documented(404, 409))
    async def delete_pool(name: PoolName, request: Request) -> Response:
        cp = _cp(request)
        await cp.delete_pool(name)
        return Response(status_code=204)

    @r.get("/devices")
    async def list_devices(request: Request, authorization: Auth = None) -> Response:
        cp = _cp(request)
        cp.require_read(bearer(authorization))
        return JSON({"items": [d.to_dict() for d in sorted(cp.state.devices.values(), key=lambda d: d.id)]})

    @admin.put("/devices/{device_id}")
    async def put_device(device_id: PoolName, body: DeviceSpec, request: Request) -> Response:
        """Create or replace a device; the body's ``id`` must be the path's ``device_id`` (422 naming ``id``)."""
        cp = _cp(request)
        if body.id != device_id:
            raise ApiError(422, "invalid", f"id {body.id!r} differs from the path's {device_id!r}", "id")
        return JSON((await cp.put_device(device_from_spec(body))).to_dict())

    @r.get("/events", responses=documented(503))
    async def list_events(
        request: Request,
        authorization: Auth = None,
        worker_id: Annotated[str | None, Query(max_length=64)] = None,
        pool: Annotated[str | None, Query(max_length=128)] = None,
        type: Annotated[list[EventType] | None, Query()] = None,
        since: Annotated[float | None, Query(ge=0, allow_inf_nan=False)] = None,
        until: Annotated[float | None, Query(ge=0, allow_inf_nan=False)] = None,
        # Event ids are SQLite/PostgreSQL 64-bit integers: a larger cursor is a 422, not an overflow in the driver.
        cursor: Annotated[int, Query(ge=0, le=2**63 - 1, description="next_cursor of the previous page")] = 0,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> Response:
        """Events filtered by worker, pool, type and time range [since, until); keyset-paginated."""
        cp = _cp(request)
        cp.require_read(bearer(authorization))
        q = EventQuery(
            worker_id=worker_id,
            pool=pool,
            types=tuple(type or ()),
            since=since,
            until=until,
            after_id=cursor,
            limit=limit,
        )
        items = await asyncio.to_thread(cp.store.query_events, q)
        next_cursor = items[-1].id if len(items) == limit else None
        return JSON({"items": [e.to_dict() for e in items], "next_cursor": next_cursor})

    @admin.post("/tokens", status_code=201, responses=documented(404))
    async def create_token(body: TokenCreate, request: Request) -> Response:
        """Create a pool (worker registration), read-only or admin token. The token is shown once; only its hash is
        kept; ``id`` names it for ``DELETE /v1/tokens/{id}``."""
        cp = _cp(request)
        token = await cp.create_token(body.kind, body.pool, body.label)
        token_id = auth.token_id(auth.hash_token(token))
        return JSON({"token": token, "id": token_id, "kind": body.kind, "pool": body.pool}, status_code=201)

    @admin.get("/tokens")
    async def list_tokens(request: Request) -> Response:
        """The tokens created through the API (never the tokens themselves): id, kind, pool, label, created_at."""
        cp = _cp(request)
        return JSON({"items": await cp.list_tokens()})

    @admin.delete("/tokens/{token_id}", status_code=204, responses=documented(404, 409))
    async def revoke_token(token_id: TokenId, request: Request) -> Response:
        """Revoke a token at once (requests with it answer 403). Workers registered with a revoked pool token keep
        their own worker tokens; deregister them to stop them."""
        cp = _cp(request)
        await cp.revoke_token(token_id)
        return Response(status_code=204)

    @r.get("/status")
    async def status(request: Request, authorization: Auth = None) -> Response:
        cp = _cp(request)
        cp.require_read(bearer(authorization))
        return JSON(cp.status())

    @r.get("/policies")
    async def get_policies(request: Request, authorization: Auth = None) -> Response:
        """The rules in force and each rule's state per scope."""
        cp = _cp(request)
        cp.require_read(bearer(authorization))
        return JSON(cp.policies.status())

    @admin.put("/policies")
    async def put_policies(body: PolicyUpload, request: Request) -> Response:
        """Validate and hot-reload a policy file; on any error nothing changes (422 with every problem)."""
        cp = _cp(request)
        try:
            await cp.policies.apply_text(body.text, body.source)
        except ConfigError as exc:
            raise ApiError(
                422, "invalid", exc.problems[0], "text", details=[{"message": p} for p in exc.problems]
            ) from None
        return JSON(cp.policies.status())

    @admin.post("/placements", responses=documented(404))
    async def create_placement(body: PlacementRequest, request: Request) -> Response:
        """Place a job's worker groups on the inventory; answers every assignment with its score per term, the
        devices left out and why, and the workers that could not be placed."""
        cp = _cp(request)
        if body.pool is not None and body.pool not in cp.state.pools:
            raise errors.not_found("pool", body.pool, "pool")
        placement = await cp.scheduler.place(job_from_dict(body.model_dump()))
        return JSON(placement.to_dict())

    @r.get("/placements")
    async def list_placements(request: Request, authorization: Auth = None) -> Response:
        cp = _cp(request)
        cp.require_read(bearer(authorization))
        return JSON({"items": [p.to_dict() for _, p in sorted(cp.scheduler.placements.items())]})

    @r.get("/placements/{job}", responses=documented(404))
    async def get_placement(job: PoolName, request: Request, authorization: Auth = None) -> Response:
        """A placement and its explanation."""
        cp = _cp(request)
        cp.require_read(bearer(authorization))
        placement = cp.scheduler.placements.get(job)
        if placement is None:
            raise errors.not_found("placement", job, "job")
        return JSON(placement.to_dict())

    @admin.delete("/placements/{job}", status_code=204, responses=documented(404))
    async def delete_placement(job: PoolName, request: Request) -> Response:
        """Release a job's devices (the job ended)."""
        cp = _cp(request)
        if not cp.scheduler.release(job):
            raise errors.not_found("placement", job, "job")
        return Response(status_code=204)

    @r.get("/profiles")
    async def device_profiles(request: Request, authorization: Auth = None) -> Response:
        """Device personalities learned from history: per device and load class, and per worker and model."""
        cp = _cp(request)
        cp.require_read(bearer(authorization))
        return JSON(cp.scheduler.profiles.to_dict())

    @admin.post("/events", status_code=201)
    async def record_event(body: EventRecord, request: Request) -> Response:
        """Record a tool's event (a launcher's recovery timeline)."""
        cp = _cp(request)
        ev = Event(ts=cp.clock(), type=EventType(body.type), pool=body.pool, worker_id=body.worker_id, data=body.data)
        (event_id,) = await cp.record_events([ev])
        return JSON({"id": event_id}, status_code=201)

    @r.get("/metrics/series")
    async def metric_series(request: Request, authorization: Auth = None) -> Response:
        """The sampled gauge history the policies read (what `dsec metrics export` saves)."""
        cp = _cp(request)
        cp.require_read(bearer(authorization))
        return JSON(cp.policies.series.export())

    @r.get("/cost", responses=documented(503))
    async def cost(
        request: Request,
        authorization: Auth = None,
        pool: Annotated[str | None, Query(max_length=128)] = None,
        since: Annotated[
            float | None, Query(ge=0, allow_inf_nan=False, description="unix seconds; default: until - 3600")
        ] = None,
        until: Annotated[
            float | None, Query(ge=0, allow_inf_nan=False, description="unix seconds; default: now")
        ] = None,
    ) -> Response:
        """Cost accounting over [since, until) per pool and group: device-hours (useful, degraded, recovering, idle)
        and their price, DSec's own overhead, the opportunity cost of degrading (docs/observability.md, "Cost
        accounting"). ``until`` must be after ``since`` (422 naming the field: ``until`` when it was given, else
        ``since``)."""
        cp = _cp(request)
        cp.require_read(bearer(authorization))
        end = cp.clock() if until is None else until
        start = end - 3600.0 if since is None else since
        if since is None:
            start = max(0.0, start)
        try:
            window = Window(start, end)
        except WindowError as exc:
            name = exc.field if exc.field == "since" or until is not None else "since"
            raise ApiError(422, "invalid", str(exc), name) from None
        report = await cp.cost.report(window, pool)
        return JSON(report.to_dict())

    r.include_router(admin)
    return r


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


def create_app(settings: Settings, store: Store | None = None, clock: Callable[[], float] = time.time) -> FastAPI:
    """Build the app. Opens (and migrates) the store now, so a bad database URL fails here, loudly."""
    # The cluster file is checked before anything is opened: a typo in it starts nothing.
    cluster = load_cluster(settings.cluster_file) if settings.cluster_file is not None else None
    owned_store = store is None
    private_dir(settings.home)  # it holds the applied policies and, for SQLite, the database: 0700 when created
    store = store or open_store(settings.database_url)
    cp = ControlPlane(settings, store, clock)
    if cluster is not None:
        cp.apply_cluster(*cluster)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
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
    app.add_exception_handler(ApiError, api_error_handler)
    app.add_exception_handler(RequestValidationError, request_validation_handler)
    app.add_exception_handler(StarletteHTTPException, http_exception_handler)
    app.add_exception_handler(ModelError, model_error_handler)
    app.add_exception_handler(StoreError, store_error_handler)
    app.include_router(ops_routes())
    app.include_router(worker_routes())
    app.include_router(batch_routes())
    app.include_router(admin_routes())
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
    _contract_openapi(app, HeartbeatRequest, HeartbeatBatch, HeartbeatItem)
    return app


def serve_target(app: FastAPI) -> Any:
    """The ASGI callable to hand to the server for an app made by ``create_app``."""
    return getattr(app.state, "asgi", app)


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
    while True:
        await asyncio.sleep(cp.settings.reconcile_interval_s)
        try:
            await cp.reconcile()
        except Exception:  # the loop must survive a store outage; the next pass retries
            log.exception("reconcile pass failed")
        await cp.cost.refresh()  # at most every cost_refresh_s; it logs its own failures
