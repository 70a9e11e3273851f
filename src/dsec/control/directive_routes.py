"""Routes of a worker's directive: what the control plane wants it to run with (desired) against what it last
acknowledged (acked); an admin changes it, the worker gets it on its next beat (docs/protocol.md)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from dsec.control.auth import bearer
from dsec.control.deps import ADMIN_ONLY, Auth, WorkerId
from dsec.control.deps import cp_of as _cp
from dsec.control.errors import ApiError, documented
from dsec.control.http import JSON
from dsec.control.schemas import DirectivePatch


def directive_routes() -> APIRouter:
    # Under /v1/workers, with the worker routes' tag and errors (worker_routes.py).
    r = APIRouter(prefix="/v1/workers", tags=["workers"], responses=documented(401, 403, 429))
    admin = APIRouter(dependencies=ADMIN_ONLY)  # admin token checked before anything else

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
