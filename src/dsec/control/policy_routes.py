"""Routes of the policy engine's rules: the rules in force with their state, and a hot reload of the policy file."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from dsec.control.auth import bearer
from dsec.control.deps import Auth, admin_api_routers
from dsec.control.deps import cp_of as _cp
from dsec.control.errors import ApiError, documented
from dsec.control.http import JSON
from dsec.control.schemas import PolicyUpload
from dsec.yamlconf import ConfigError


def policy_routes() -> APIRouter:
    r, admin = admin_api_routers()

    @r.get("/policies")
    async def get_policies(request: Request, authorization: Auth = None) -> Response:
        """The rules in force and each rule's state per scope."""
        cp = _cp(request)
        cp.require_read(bearer(authorization))
        return JSON(cp.policies.status())

    @admin.put("/policies", responses=documented(409))
    async def put_policies(body: PolicyUpload, request: Request) -> Response:
        """Validate, store (as the next policy version) and hot-reload a policy file; on any error nothing changes
        (422 with every problem; 409 when another control plane on the same database stored that version)."""
        cp = _cp(request)
        try:
            await cp.policies.apply_text(body.text, body.source)
        except ConfigError as exc:
            raise ApiError(
                422, "invalid", exc.problems[0], "text", details=[{"message": p} for p in exc.problems]
            ) from None
        return JSON(cp.policies.status())

    r.include_router(admin)
    return r
