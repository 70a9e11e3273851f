"""Routes of the inventory: pools and devices (read with an admin or read token, written with an admin token)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from dsec.control import errors
from dsec.control.auth import bearer
from dsec.control.cluster import device_from_spec, pool_from_spec
from dsec.control.deps import Auth, PoolName, admin_api_routers
from dsec.control.deps import cp_of as _cp
from dsec.control.errors import ApiError, documented
from dsec.control.http import JSON
from dsec.control.schemas import DeviceSpec, PoolUpdate


def inventory_routes() -> APIRouter:
    r, admin = admin_api_routers()

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

    r.include_router(admin)
    return r
