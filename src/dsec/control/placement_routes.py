"""Routes of the scheduler: place a job's worker groups, read and release placements, and the device profiles the
placement scores come from."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from dsec.control import errors
from dsec.control.auth import bearer
from dsec.control.deps import Auth, PoolName, admin_api_routers
from dsec.control.deps import cp_of as _cp
from dsec.control.errors import documented
from dsec.control.http import JSON
from dsec.control.schemas import PlacementRequest
from dsec.scheduler.placement import job_from_dict


def placement_routes() -> APIRouter:
    r, admin = admin_api_routers()

    @admin.post("/placements", responses=documented(404, 409))
    async def create_placement(body: PlacementRequest, request: Request, complete_only: bool = False) -> Response:
        """Place a job's worker groups on the inventory; answers every assignment with its score per term, the
        devices left out and why, and the workers that could not be placed. ``complete_only``: a placement that
        leaves a worker unplaced is answered 409 (naming them) and not recorded — the job's placement in force, and
        the devices it holds, stay as they were (a launcher moving some workers of a running job asks so)."""
        cp = _cp(request)
        if body.pool is not None and body.pool not in cp.state.pools:
            raise errors.not_found("pool", body.pool, "pool")
        for i, g in enumerate(body.groups):
            for j, w in enumerate(g.workers):
                if w.device is not None and w.device not in cp.state.devices:
                    field = f"groups[{i}].workers[{j}].device"
                    raise errors.ApiError(422, "invalid", f"{field}: no device {w.device!r} in the inventory", field)
        placement = await cp.scheduler.place(job_from_dict(body.model_dump()), complete_only=complete_only)
        if complete_only and not placement.complete:
            unplaced = "; ".join(f"{w}: {why}" for w, why in sorted(placement.unplaced.items()))
            raise errors.conflict(f"job {body.name} cannot be placed whole, nothing recorded ({unplaced})", "groups")
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
        if not await cp.scheduler.release(job):
            raise errors.not_found("placement", job, "job")
        return Response(status_code=204)

    @r.get("/profiles")
    async def device_profiles(request: Request, authorization: Auth = None) -> Response:
        """Device personalities learned from history: per device and load class, and per worker and model."""
        cp = _cp(request)
        cp.require_read(bearer(authorization))
        return JSON(cp.scheduler.profiles.to_dict())

    r.include_router(admin)
    return r
