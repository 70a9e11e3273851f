"""The healing routes (``/v1/heal/{run}``; the protocol is described in control/healing.py): authentication, then
the registry does the work."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Header, Path, Query, Request
from starlette.responses import Response

from dsec.control import errors
from dsec.control.auth import bearer
from dsec.control.errors import documented
from dsec.control.heal_bodies import RUN_PATTERN, AdmitBody, FailBody, JoinBody, LeaveBody
from dsec.control.healing import HealRegistry
from dsec.control.http import JSON

Auth = Annotated[str | None, Header(alias="Authorization", include_in_schema=False)]
Run = Annotated[str, Path(pattern=RUN_PATTERN)]
_ANY_JSON = {"application/json": {"schema": {"type": "object"}}}


def _tokens(lookup: Callable[[Request, str | None], Any], request: Request, token: str | None) -> Any:
    if token is None:
        raise errors.unauthorized()
    return lookup(request, token)


def heal_routes(registry: Callable[[Request], HealRegistry], lookup: Callable[[Request, str | None], Any]) -> APIRouter:
    """``lookup(request, token)`` -> (pool of the token or None, is admin)."""
    # Not rate limited (see ratelimit.py); every route checks a token.
    r = APIRouter(prefix="/v1/heal", tags=["healing"], responses=documented(401, 403))
    # Routes that look an existing run up (404 to an admin token), and those that record heal events (503).
    lookup_run, records = documented(404), documented(503)

    def tokens(request: Request, token: str | None) -> Any:
        return _tokens(lookup, request, token)

    @r.post(
        "/{run}/join",
        responses={202: {"description": "no epoch formed within the poll: join again", "content": _ANY_JSON}}
        | documented(409)
        | records,
    )
    async def join(run: Run, body: JoinBody, request: Request, authorization: Auth = None) -> Response:
        """Join the next epoch of a healing group (long-poll: 200 with the plan, or 202 to ask again)."""
        pool, admin = tokens(request, bearer(authorization))
        status, out = await registry(request).join(run, body, pool, admin, request.is_disconnected)
        return JSON(out, status_code=status)

    @r.post("/{run}/admit", responses={**documented(409), **lookup_run, **records})
    async def admit(run: Run, body: AdmitBody, request: Request, authorization: Auth = None) -> Response:
        """A member reached the agreed admission point (long-poll: the new epoch's plan, broken, or void)."""
        pool, admin = tokens(request, bearer(authorization))
        return JSON(await registry(request).admit(run, body, pool, admin, request.is_disconnected))

    @r.post("/{run}/fail", responses={**documented(409), **records})
    async def fail(run: Run, body: FailBody, request: Request, authorization: Auth = None) -> Response:
        """Report the epoch broken: a member's collective failed, or a supervisor saw ``dead_rank`` exit."""
        pool, admin = tokens(request, bearer(authorization))
        return JSON(await registry(request).fail(run, body, pool, admin))

    @r.post("/{run}/leave", responses={**documented(409), **lookup_run, **records})
    async def leave(run: Run, body: LeaveBody, request: Request, authorization: Auth = None) -> Response:
        """A member finished cleanly; its exit is not a failure."""
        pool, admin = tokens(request, bearer(authorization))
        return JSON(await registry(request).leave(run, body, pool, admin))

    @r.get("/{run}/watch", responses=lookup_run)
    async def watch(
        run: Run,
        request: Request,
        authorization: Auth = None,
        since: Annotated[int, Query(ge=0, le=2**53)] = 0,
        timeout: Annotated[float, Query(ge=0.0, le=60.0)] = 20.0,
    ) -> Response:
        """Long-poll until the group changes past version ``since``: epoch, phase, waiting replacements."""
        pool, admin = tokens(request, bearer(authorization))
        return JSON(await registry(request).watch(run, since, pool, admin, timeout, request.is_disconnected))

    @r.get("/{run}", responses=lookup_run)
    async def state(run: Run, request: Request, authorization: Auth = None) -> Response:
        """The group's membership, epoch and plan."""
        pool, admin = tokens(request, bearer(authorization))
        return JSON(registry(request).state(run, pool, admin))

    return r
