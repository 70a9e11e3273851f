"""Routes of the webhook protocol for agent runtimes (control/runtimes.py, docs/webhooks.md)."""

from __future__ import annotations

import fnmatch
from urllib.parse import urlsplit

from fastapi import APIRouter, Request
from starlette.responses import Response

from dsec.control import auth, errors
from dsec.control.auth import bearer
from dsec.control.deps import ADMIN_ONLY, Auth, WorkerId, cp_of
from dsec.control.egress import check_callback_url
from dsec.control.errors import ApiError, documented
from dsec.control.http import JSON
from dsec.control.runtimes import Runtime
from dsec.control.schemas import PolicyPush, RuntimeRegister, RuntimeReport
from dsec.control.service import ControlPlane


def _allowed_host(cp: ControlPlane, url: str) -> bool:
    host = (urlsplit(url).hostname or "").lower()
    return any(fnmatch.fnmatchcase(host, pattern.lower()) for pattern in cp.settings.webhook_allowed_hosts)


def _registrant_pool(cp: ControlPlane, token: str | None, body: RuntimeRegister) -> str | None:
    """The runtime's pool, once the token may register it: an admin token anything, a pool token a runtime of its
    own pool whose callback host is on the allow-list (it makes the control plane send requests there)."""
    if token is None:
        raise errors.unauthorized()
    token_pool = cp.pool_of_token(token)
    if token_pool is None:
        cp.require_admin(token)
        return body.pool
    if body.pool not in (None, token_pool):
        raise errors.forbidden(
            f"this token registers runtimes in pool {token_pool!r} only, not in {body.pool!r}", "pool"
        )
    if not _allowed_host(cp, body.callback_url):
        raise errors.forbidden(
            "a pool token may register a runtime only for a callback host on the allow-list "
            "(webhook_allowed_hosts, DSEC_WEBHOOK_ALLOWED_HOSTS); an admin token may register any",
            "callback_url",
        )
    return token_pool


def _runtime(cp: ControlPlane, runtime_id: str) -> Runtime:
    rt = cp.runtimes.runtimes.get(runtime_id)
    if rt is None:
        raise errors.not_found("runtime", runtime_id, "runtime_id")
    return rt


def runtime_routes() -> APIRouter:
    # each route checks its own mix of tokens; all are rate limited
    r = APIRouter(prefix="/v1/runtimes", tags=["runtimes"], responses=documented(401, 403, 429))

    @r.post("", status_code=201, responses=documented(404, 503))
    async def register_runtime(body: RuntimeRegister, request: Request, authorization: Auth = None) -> Response:
        """Register an agent runtime (admin token, or a pool token for its own pool and an allow-listed callback
        host); answers its runtime token, shown once."""
        cp = cp_of(request)
        pool = _registrant_pool(cp, bearer(authorization), body)
        try:
            check_callback_url(body.callback_url, cp.settings.webhook_allow_private)
        except ValueError as exc:
            raise ApiError(422, "invalid", f"callback_url: {exc}", "callback_url") from None
        if pool is not None and pool not in cp.state.pools:
            raise errors.not_found("pool", pool, "pool")
        runtime_token = auth.new_token(auth.RUNTIME_PREFIX)
        rt = await cp.runtimes.register(
            body.name, body.type, body.callback_url, body.secret, pool, auth.hash_token(runtime_token)
        )
        return JSON({**rt.to_api(), "runtime_token": runtime_token}, status_code=201)

    @r.post("/{runtime_id}/report", responses=documented(404, 503))
    async def runtime_report(
        runtime_id: WorkerId, body: RuntimeReport, request: Request, authorization: Auth = None
    ) -> Response:
        """A runtime's report: concurrent agent instances, average LLM-call latency, function calling on/off."""
        cp = cp_of(request)
        token = bearer(authorization)
        if token is None:
            raise errors.unauthorized()
        if cp.is_admin(token):
            rt = _runtime(cp, runtime_id)
        else:
            # Authenticated before looked up: an unknown id and another runtime's id answer the same.
            found = cp.runtimes.runtimes.get(runtime_id)
            if found is None or not auth.same_hash(auth.hash_token(token), found.token_hash):
                raise errors.forbidden(f"this token may not report for runtime_id {runtime_id!r}", "runtime_id")
            rt = found
        await cp.runtimes.record_report(rt, body.model_dump())
        pending = sum(1 for d in cp.runtimes.deliveries_of(rt.id) if d.status == "pending")
        return JSON({"ok": True, "pending_deliveries": pending})

    @r.get("")
    async def list_runtimes(request: Request, authorization: Auth = None) -> Response:
        cp = cp_of(request)
        cp.require_read(bearer(authorization))
        return JSON({"items": [rt.to_api() for rt in sorted(cp.runtimes.runtimes.values(), key=lambda r: r.id)]})

    r.include_router(_admin_routes())
    return r


def _admin_routes() -> APIRouter:
    """The admin-only runtime routes (included under ``runtime_routes``' prefix, after its own routes)."""
    admin = APIRouter(dependencies=ADMIN_ONLY)  # admin token checked before anything else

    @admin.delete("/{runtime_id}", status_code=204, responses=documented(404, 503))
    async def delete_runtime(runtime_id: WorkerId, request: Request) -> Response:
        """Forget a runtime: its token stops working, its pending deliveries fail."""
        cp = cp_of(request)
        if not await cp.runtimes.remove(_runtime(cp, runtime_id).id):
            raise errors.not_found("runtime", runtime_id, "runtime_id")
        return Response(status_code=204)

    @admin.post("/{runtime_id}/policies", status_code=202, responses=documented(404))
    async def push_policy(runtime_id: WorkerId, body: PolicyPush, request: Request) -> Response:
        """Push a policy to a runtime's callback: signed, retried with backoff; answers the delivery to follow."""
        cp = cp_of(request)
        rt = _runtime(cp, runtime_id)
        d = cp.runtimes.push(rt.id, body.model_dump())
        return JSON(d.to_api(), status_code=202)

    @admin.get("/{runtime_id}/deliveries", responses=documented(404))
    async def runtime_deliveries(runtime_id: WorkerId, request: Request) -> Response:
        """The delivery log: every push with its attempts (time, HTTP status or error, duration, bytes read) and
        outcome. Admin only: answers come from hosts outside the control plane."""
        cp = cp_of(request)
        rt = _runtime(cp, runtime_id)
        return JSON({"items": [d.to_api() for d in cp.runtimes.deliveries_of(rt.id)]})

    return admin
