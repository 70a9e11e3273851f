"""Tokens and what they reveal, against a real control plane on loopback (docs/security.md, findings 8 and 9, the
read-only scope and per-token rate limits)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import Harness, make_settings
from dsec.client import ApiError, Client


def status_of(c: Client, method: str, path: str, **kw: object) -> int:
    try:
        c.request(method, path, **kw)  # type: ignore[arg-type]
    except ApiError as exc:
        return exc.status
    return 200


# -- finding 8: revocation -------------------------------------------------------------------------------------------
def test_a_revoked_token_stops_working_at_once_and_after_a_restart(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    settings = make_settings(tmp_path / "h")
    h = server_factory(settings=settings, pools=True)
    created = h.admin.request("POST", "/v1/tokens", json={"kind": "pool", "pool": "pool-a", "label": "ci"})
    token, token_id = created["token"], created["id"]
    listed = h.admin.request("GET", "/v1/tokens")["items"]
    mine = next(t for t in listed if t["id"] == token_id)
    assert mine == {"id": token_id, "kind": "pool", "pool": "pool-a", "label": "ci", "created_at": mine["created_at"]}
    assert all(token not in str(t) for t in listed), "a listing never shows a token"
    h.register("pool-a", token=token)
    h.admin.request("DELETE", f"/v1/tokens/{token_id}")
    with pytest.raises(ApiError) as info:
        h.register("pool-a", token=token)
    assert info.value.status == 403
    assert token_id not in {t["id"] for t in h.admin.request("GET", "/v1/tokens")["items"]}
    with pytest.raises(ApiError) as info:
        h.admin.request("DELETE", f"/v1/tokens/{token_id}")
    assert info.value.status == 404 and info.value.field == "token_id"
    h.close()
    again = server_factory(settings=settings, port=h.port)
    with pytest.raises(ApiError) as info:
        again.register("pool-a", token=token)
    assert info.value.status == 403


def test_the_configured_admin_token_cannot_be_revoked_over_the_api(server: Harness) -> None:
    import hashlib

    own_id = hashlib.sha256(server.admin_token.encode()).hexdigest()[:16]
    with pytest.raises(ApiError) as info:
        server.admin.request("DELETE", f"/v1/tokens/{own_id}")
    assert info.value.status == 409 and "DSEC_ADMIN_TOKEN" in info.value.message
    assert server.admin.pools()


def test_pool_tokens_are_revoked_with_their_pool(server: Harness) -> None:
    old = server.pool_tokens["pool-b"]
    server.admin.request("DELETE", "/v1/pools/pool-b")
    server.admin.put_pool("pool-b")
    with pytest.raises(ApiError) as info:
        server.register("pool-b", token=old)
    assert info.value.status == 403
    assert server.register("pool-b", token=server.admin.create_token("pool-b")).answer["worker_id"]


# -- finding 9: what an error tells ----------------------------------------------------------------------------------
def test_unknown_and_foreign_ids_answer_alike_to_non_admin_tokens(server: Harness) -> None:
    w = server.register("pool-a")
    c = server.client(server.pool_tokens["pool-a"])
    for path in ("/v1/runtimes/rt-doesnotexist/report", "/v1/runtimes/rt-0123456789ab/report"):
        report = {"concurrent_agents": 1, "avg_llm_latency_ms": 1.0, "function_calling": False}
        assert status_of(c, "POST", path, json=report) == 403
    wc = server.client(w.token)
    unknown = status_of(wc, "GET", "/v1/workers/w-doesnotexist/directive")
    foreign = status_of(wc, "GET", f"/v1/workers/{server.register('pool-b').id}/directive")
    assert unknown == foreign == 403


def test_readyz_does_not_tell_store_errors_to_anyone(server: Harness) -> None:
    db = Path(server.database_url.split("///", 1)[1])
    store = _store_of(server)
    store.close()  # every pooled connection goes; the next one opens the path again
    saved = db.with_name("saved.db")
    db.rename(saved)
    db.mkdir()  # SQLite cannot open a directory: "unable to open database file"
    try:
        with server.http() as http:
            r = http.get("/readyz")
        assert r.status_code == 503
        assert r.json() == {"status": "unavailable", "reason": "state store unavailable"}
        assert str(db) not in r.text and "sqlite" not in r.text.lower()
    finally:
        db.rmdir()
        saved.rename(db)


def _store_of(h: Harness):  # type: ignore[no-untyped-def]
    """The store of the app this harness serves (for the test that breaks it)."""
    app = h.server.server.config.app
    while not hasattr(app, "state") or not hasattr(app.state, "cp"):
        app = app.app  # the heartbeat shortcut wraps the FastAPI app
    return app.state.cp.store


def test_api_docs_are_off_unless_enabled(server_factory: Callable[..., Harness], tmp_path: Path) -> None:
    h = server_factory(settings=make_settings(tmp_path / "a"))
    with h.http() as http:
        assert http.get("/docs").status_code == 404 and http.get("/redoc").status_code == 404
        assert http.get("/openapi.json").status_code == 200
    on = server_factory(settings=make_settings(tmp_path / "b", api_docs=True))
    with on.http() as http:
        assert http.get("/docs").status_code == 200


# -- read-only tokens ------------------------------------------------------------------------------------------------
def test_a_read_token_reads_everything_and_changes_nothing(server: Harness) -> None:
    w = server.register("pool-a")
    read = server.admin.request("POST", "/v1/tokens", json={"kind": "read", "label": "dashboard"})["token"]
    assert read.startswith("dsv_")
    c = server.client(read)
    for path in ("/v1/status", "/v1/workers", f"/v1/workers/{w.id}", f"/v1/workers/{w.id}/directive", "/v1/pools",
                 "/v1/pools/pool-a", "/v1/devices", "/v1/events", "/v1/policies", "/v1/metrics/series",
                 "/v1/placements", "/v1/profiles", "/v1/runtimes", "/v1/cost"):  # fmt: skip
        assert status_of(c, "GET", path) == 200, path
    writes = [
        ("PATCH", f"/v1/workers/{w.id}/directive", {"compression_bits": 8}),
        ("POST", f"/v1/workers/{w.id}/deregister", None),
        ("POST", f"/v1/workers/{w.id}/heartbeat", {"seq": 1}),
        ("POST", "/v1/workers/register", {"pool": "pool-a"}),
        ("PUT", "/v1/pools/pool-c", {}),
        ("DELETE", "/v1/pools/pool-b", None),
        ("POST", "/v1/tokens", {"kind": "read"}),
        ("GET", "/v1/tokens", None),
        ("PUT", "/v1/policies", {"text": ""}),
        ("POST", "/v1/events", {"type": "log"}),
        ("POST", "/v1/placements", {"name": "j", "groups": [{"name": "g", "workers": [{"name": "x"}]}]}),
    ]
    for method, path, body in writes:
        assert status_of(c, method, path, json=body) == 403, (method, path)
    view = server.admin.worker(w.id)
    assert view["state"] == "active" and view["directive"]["desired_version"] == 1
    assert [p["name"] for p in server.admin.pools()] == ["pool-a", "pool-b"]


# -- per-token rate limits -------------------------------------------------------------------------------------------
def test_requests_per_token_are_rate_limited_except_admin_and_heartbeats(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    h = server_factory(settings=make_settings(tmp_path / "h", rate_limit_per_s=0.01, rate_limit_burst=3), pools=True)
    read = h.admin.create_token(kind="read")
    with h.http() as http:
        auth = {"Authorization": f"Bearer {read}"}
        assert [http.get("/v1/status", headers=auth).status_code for _ in range(3)] == [200] * 3
        limited = http.get("/v1/status", headers=auth)
        assert limited.status_code == 429 and limited.json()["field"] == "Authorization"
        assert int(limited.headers["retry-after"]) >= 1
        assert all(http.get("/v1/status", headers={"Authorization": f"Bearer {h.admin_token}"}).status_code == 200
                   for _ in range(10))  # fmt: skip
    # The pool token has its own budget; the workers it registers beat as often as they need to.
    w = h.register("pool-a")
    wc = h.client(w.token)
    for seq in range(1, 11):
        wc.heartbeat(w.id, seq, metrics={"x": float(seq)})
    assert h.admin.worker(w.id)["last_seq"] == 10
