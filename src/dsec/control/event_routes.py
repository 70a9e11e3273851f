"""Routes of the event log: read it (filtered, keyset-paginated) and record a tool's event."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from dsec.control.auth import bearer
from dsec.control.deps import Auth, admin_api_routers
from dsec.control.deps import cp_of as _cp
from dsec.control.errors import documented
from dsec.control.http import JSON
from dsec.control.schemas import EventRecord
from dsec.control.store import EventQuery
from dsec.model import Event, EventType


def event_routes() -> APIRouter:
    r, admin = admin_api_routers()

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

    @admin.post("/events", status_code=201)
    async def record_event(body: EventRecord, request: Request) -> Response:
        """Record a tool's event (a launcher's recovery timeline)."""
        cp = _cp(request)
        ev = Event(ts=cp.clock(), type=EventType(body.type), pool=body.pool, worker_id=body.worker_id, data=body.data)
        (event_id,) = await cp.record_events([ev])
        return JSON({"id": event_id}, status_code=201)

    r.include_router(admin)
    return r
