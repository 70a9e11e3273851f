"""What every route module shares: the Authorization header, path parameters, the app's ControlPlane and the routers
of the admin API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

from fastapi import APIRouter, Depends, Header, Path, Request
from fastapi.params import Depends as DependsParam

from dsec.control.auth import bearer
from dsec.control.errors import documented
from dsec.control.schemas import NAME_PATTERN

if TYPE_CHECKING:
    from dsec.control.service import ControlPlane

Auth = Annotated[str | None, Header(alias="Authorization", include_in_schema=False)]
WorkerId = Annotated[str, Path(pattern=r"^[A-Za-z0-9_.:-]{1,64}$")]
PoolName = Annotated[str, Path(pattern=NAME_PATTERN)]
TokenId = Annotated[str, Path(pattern=r"^[0-9a-f]{16}$", description="the id POST /v1/tokens answered")]


def cp_of(request: Request) -> ControlPlane:
    cp: ControlPlane = request.app.state.cp
    return cp


async def require_admin(request: Request, authorization: Auth = None) -> None:
    """401 without a token, 403 with any but an admin token. Async: a sync dependency would hop to a thread."""
    cp_of(request).require_admin(bearer(authorization))


# ``APIRouter(dependencies=ADMIN_ONLY)``: the check belongs to the router, so a route added to it cannot forget it.
ADMIN_ONLY: list[DependsParam] = [Depends(require_admin)]


def admin_api_routers() -> tuple[APIRouter, APIRouter]:
    """The two routers of an admin API module: the first for its read routes (each checks an admin or read token
    itself), the second for its admin routes. Include the second in the first once every route is declared."""
    r = APIRouter(prefix="/v1", tags=["admin"], responses=documented(401, 403, 429))  # read routes: admin or read token
    # admin token checked before anything else; every admin route writes to (or reads) the store: 503 when it fails
    admin = APIRouter(dependencies=ADMIN_ONLY, responses=documented(503))
    return r, admin
