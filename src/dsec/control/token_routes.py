"""Routes of the API tokens: create (shown once), list (never the tokens themselves) and revoke; admin only."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from dsec.control import auth
from dsec.control.deps import TokenId, admin_api_routers
from dsec.control.deps import cp_of as _cp
from dsec.control.errors import documented
from dsec.control.http import JSON
from dsec.control.schemas import TokenCreate


def token_routes() -> APIRouter:
    r, admin = admin_api_routers()

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

    r.include_router(admin)
    return r
