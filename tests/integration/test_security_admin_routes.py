"""Every route that is not explicitly meant for other tokens is admin-only, and checks it before anything else.

The routes come from the app's OpenAPI document (FastAPI's public view of its routing table), so a route added
later is covered without editing this file: on the admin router it passes; on another router without being added
to ``NOT_ADMIN`` (with the check it does instead) it fails here.
"""

from __future__ import annotations

import re

import pytest

from conftest import Harness
from dsec.client import ApiError

# Routes that answer other tokens too, and the check each does instead of the admin router's.
NOT_ADMIN = {
    # ops: no token (liveness, readiness, Prometheus scrape)
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    # the worker protocol: a pool token registers, the worker's own token does the rest
    ("POST", "/v1/workers/register"),
    ("POST", "/v1/workers/{worker_id}/heartbeat"),
    # batches of heartbeats: sent with a known worker's token, each item authorized by its own worker token
    ("POST", "/v1/heartbeats"),
    ("POST", "/v1/workers/{worker_id}/deregister"),
    ("GET", "/v1/workers/{worker_id}/directive"),
    # reads: an admin or read-only token (require_read)
    ("GET", "/v1/workers"),
    ("GET", "/v1/workers/{worker_id}"),
    ("GET", "/v1/pools"),
    ("GET", "/v1/pools/{name}"),
    ("GET", "/v1/devices"),
    ("GET", "/v1/events"),
    ("GET", "/v1/status"),
    ("GET", "/v1/policies"),
    ("GET", "/v1/placements"),
    ("GET", "/v1/placements/{job}"),
    ("GET", "/v1/profiles"),
    ("GET", "/v1/metrics/series"),
    ("GET", "/v1/cost"),
    ("GET", "/v1/runtimes"),
    # runtimes: a pool token registers one for its own pool; the runtime's own token reports
    ("POST", "/v1/runtimes"),
    ("POST", "/v1/runtimes/{runtime_id}/report"),
    # healing: the members' pool token for their run (control/healing.py)
    ("POST", "/v1/heal/{run}/join"),
    ("POST", "/v1/heal/{run}/admit"),
    ("POST", "/v1/heal/{run}/fail"),
    ("POST", "/v1/heal/{run}/leave"),
    ("GET", "/v1/heal/{run}/watch"),
    ("GET", "/v1/heal/{run}"),
}

# A value each path parameter's pattern accepts; a new parameter must be added here.
PLACEHOLDERS = {
    "worker_id": "w-0",
    "name": "pool-a",
    "device_id": "dev-0",
    "token_id": "0123456789abcdef",
    "job": "job-0",
    "runtime_id": "rt-0",
    "run": "run-0",
}


def _routes(server: Harness) -> set[tuple[str, str]]:
    with server.http() as http:
        paths = http.get("/openapi.json").json()["paths"]  # served even with api_docs off (only the UIs are)
    return {(method.upper(), path) for path, ops in paths.items() for method in ops}


def _url(path: str) -> str:
    def fill(m: re.Match[str]) -> str:
        assert m.group(1) in PLACEHOLDERS, f"no placeholder for path parameter {m.group(1)!r}: add one"
        return PLACEHOLDERS[m.group(1)]

    return re.sub(r"\{(\w+)\}", fill, path)


def test_every_admin_route_refuses_every_other_token_before_reading_the_request(server: Harness) -> None:
    worker = server.register("pool-a")
    tokens = {
        "no token": None,
        "read token": server.admin.create_token(kind="read"),
        "pool token": server.pool_tokens["pool-a"],
        "worker token": worker.token,
        "not a token": "dsa_made-up",
    }
    routes = _routes(server)
    admin_routes = sorted(routes - NOT_ADMIN)
    assert ("POST", "/v1/tokens") in admin_routes  # the listing is not empty or mangled
    assert not NOT_ADMIN - routes, f"NOT_ADMIN names routes that no longer exist: {NOT_ADMIN - routes}"
    wrong = []
    with server.http() as http:
        for method, path in admin_routes:
            for what, token in tokens.items():
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                # A body no route accepts: an in-handler check would come after validation and answer 422.
                body = b"[]" if method in ("POST", "PUT", "PATCH") else None
                if body is not None:
                    headers["Content-Type"] = "application/json"
                resp = http.request(method, _url(path), headers=headers, content=body)
                expected = 401 if token is None else 403
                if resp.status_code != expected:
                    wrong.append(f"{method} {path} with {what}: {resp.status_code}, expected {expected}")
    assert wrong == []


def test_the_admin_token_passes_the_router_check(server: Harness) -> None:
    # the same malformed body as above now reaches validation: the check let the admin through
    with server.http() as http:
        resp = http.put(
            "/v1/pools/pool-a",
            content=b"[]",
            headers={"Authorization": f"Bearer {server.admin_token}", "Content-Type": "application/json"},
        )
    assert resp.status_code == 422
    assert server.admin.put_pool("pool-c")["name"] == "pool-c"
    with pytest.raises(ApiError) as info:
        server.client(server.pool_tokens["pool-a"]).put_pool("pool-d")
    assert info.value.status == 403
