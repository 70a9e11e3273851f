"""Read-only routes of what the control plane reports: the fleet's status, the sampled gauge history the policies
read, and cost accounting (an admin or read token)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from dsec.control.auth import bearer
from dsec.control.deps import Auth, admin_api_routers
from dsec.control.deps import cp_of as _cp
from dsec.control.errors import ApiError, documented
from dsec.control.http import JSON
from dsec.cost import Window, WindowError


def report_routes() -> APIRouter:
    r, _ = admin_api_routers()  # read routes only

    @r.get("/status")
    async def status(request: Request, authorization: Auth = None) -> Response:
        cp = _cp(request)
        cp.require_read(bearer(authorization))
        return JSON(cp.status())

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

    return r
