"""The healing routes on a real server: a group forms, breaks and re-forms over HTTP long-polls; bad input is a
422 naming the field; another pool's token is refused; a dead incarnation is fenced (409); watch returns as soon as
the group changes; epoch numbers survive a control-plane restart."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from conftest import Harness


def _join(h: Harness, run: str, rank: int, inc: str, results: dict[int, Any], token: str, **kw: Any) -> None:
    body = {"pool": "pool-a", "world": 2, "rank": rank, "incarnation": inc, "address": f"127.0.0.1:{9000 + rank}"}
    body.update(kw)
    with httpx.Client(base_url=h.url, timeout=30) as c:
        r = c.post(f"/v1/heal/{run}/join", json=body, headers={"Authorization": f"Bearer {token}"})
        results[rank] = (r.status_code, r.json())


def _join_all(h: Harness, run: str, bodies: dict[int, dict[str, Any]]) -> dict[int, Any]:
    results: dict[int, Any] = {}
    token = h.pool_tokens["pool-a"]
    threads = [
        threading.Thread(target=_join, args=(h, run, r, b.pop("incarnation"), results, token), kwargs=b)
        for r, b in bodies.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_form_break_reform_and_fence(server: Harness) -> None:
    got = _join_all(server, "r1", {0: {"incarnation": "a0"}, 1: {"incarnation": "a1"}})
    assert {s for s, _ in got.values()} == {200}
    plan = got[0][1]["plan"]
    assert plan["epoch"] == 1 and plan["members"] == [0, 1] and got[1][1]["plan"] == plan
    admin = server.admin
    # A supervisor saw rank 1's process exit: the survivor re-forms alone at once (no timeout to wait).
    admin.request("POST", "/v1/heal/r1/fail", json={"dead_rank": 1, "reason": "exit -9"})
    t0 = time.monotonic()
    got = _join_all(server, "r1", {0: {"incarnation": "a0", "epoch": 1, "completed": 12}})
    assert got[0][0] == 200 and got[0][1]["plan"]["members"] == [0] and time.monotonic() - t0 < 2
    # The dead incarnation cannot come back.
    got = _join_all(server, "r1", {1: {"incarnation": "a1", "epoch": 1, "completed": 12}})
    assert got[1][0] == 409 and got[1][1]["error"] == "fenced"
    state = admin.request("GET", "/v1/heal/r1")
    assert state["epoch"] == 2 and state["members"] == [0] and state["plan"]["dead"] == [1]


def test_bad_input_and_authorization(server: Harness) -> None:
    token = server.pool_tokens["pool-a"]
    with httpx.Client(base_url=server.url, timeout=10) as c:
        good = {"pool": "pool-a", "world": 2, "rank": 0, "incarnation": "x", "address": "127.0.0.1:1"}
        for field, value in (("rank", -1), ("world", 0), ("address", "nohost"), ("incarnation", "a b"), ("rank", True)):
            r = c.post("/v1/heal/r2/join", json={**good, field: value}, headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 422 and field in str(r.json()), (field, r.text)
        r = c.post("/v1/heal/r2/join", json={**good, "rank": 5}, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 422 and "out of range" in r.json()["message"]
        other = server.pool_tokens["pool-b"]
        r = c.post("/v1/heal/r2/join", json=good, headers={"Authorization": f"Bearer {other}"})
        assert r.status_code == 403
        r = c.post("/v1/heal/bad run/join", json=good, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code in (404, 422)
        # An unknown run answers a pool token like another pool's run (runs cannot be probed for); an admin: 404.
        r = c.get("/v1/heal/unknown", headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 403
        r = c.get("/v1/heal/unknown", headers={"Authorization": f"Bearer {server.admin_token}"})
        assert r.status_code == 404
        r = c.post("/v1/heal/r2/join", json=good)
        assert r.status_code == 401


def test_watch_returns_when_the_group_changes(server: Harness) -> None:
    _join_all(server, "r3", {0: {"incarnation": "b0"}, 1: {"incarnation": "b1"}})
    token = server.pool_tokens["pool-a"]
    with httpx.Client(base_url=server.url, timeout=30) as c:
        h = {"Authorization": f"Bearer {token}"}
        v = c.get("/v1/heal/r3/watch", params={"since": 0}, headers=h).json()
        assert v["epoch"] == 1 and v["phase"] == "stable"
        out: dict[str, Any] = {}

        def watch() -> None:
            t0 = time.monotonic()
            out["view"] = c.get("/v1/heal/r3/watch", params={"since": v["version"], "timeout": 20}, headers=h).json()
            out["s"] = time.monotonic() - t0

        t = threading.Thread(target=watch)
        t.start()
        time.sleep(0.3)
        server.admin.request("POST", "/v1/heal/r3/fail", json={"epoch": 1, "reason": "a collective failed"})
        t.join(10)
    assert out["view"]["phase"] == "broken" and out["s"] < 5


def test_epochs_never_repeat_across_a_restart(server_factory: Callable[..., Harness]) -> None:
    first = server_factory(pools=True)
    _join_all(first, "r4", {0: {"incarnation": "c0"}, 1: {"incarnation": "c1"}})
    first.admin.request("POST", "/v1/heal/r4/fail", json={"dead_rank": 1})
    _join_all(first, "r4", {0: {"incarnation": "c0", "epoch": 1, "completed": 3}})
    settings, port = first.settings, first.port
    first.close()
    second = server_factory(settings=settings, port=port)
    second.pool_tokens.update(first.pool_tokens)
    # The restarted control plane lost the membership; the member's own view rebuilds it, at the next epoch.
    second.admin.request("POST", "/v1/heal/r4/fail", json={"epoch": 2, "pool": "pool-a", "world": 2})
    got = _join_all(second, "r4", {0: {"incarnation": "c0", "epoch": 2, "completed": 9, "view": [0]}})
    assert got[0][0] == 200 and got[0][1]["plan"]["epoch"] == 3


def test_a_watch_from_before_a_restart_is_answered_at_once(server_factory: Callable[..., Harness]) -> None:
    """A member blocked in a collective learns that its epoch broke from its watch: the version it holds from the
    previous control plane must not keep its watch waiting on the restarted one."""
    first = server_factory(pools=True)
    _join_all(first, "r5", {0: {"incarnation": "d0"}, 1: {"incarnation": "d1"}})
    h = {"Authorization": f"Bearer {first.pool_tokens['pool-a']}"}
    with httpx.Client(base_url=first.url, timeout=30) as c:
        before = c.get("/v1/heal/r5/watch", params={"since": 0}, headers=h).json()["version"]
    settings, port = first.settings, first.port
    first.close()
    second = server_factory(settings=settings, port=port)
    second.admin.request("POST", "/v1/heal/r5/fail", json={"epoch": 1, "pool": "pool-a", "world": 2})
    with httpx.Client(base_url=second.url, timeout=30) as c:
        for since in (before, 2**53):  # the previous control plane's version; one no control plane handed out
            t0 = time.monotonic()
            r = c.get("/v1/heal/r5/watch", params={"since": since, "timeout": 10}, headers=h)
            assert r.status_code == 200 and time.monotonic() - t0 < 3, (since, r.text)
        assert r.json()["version"] > before and r.json()["epoch"] == 1


@pytest.mark.parametrize("path", ["admit", "leave"])
def test_unknown_runs_are_refused_before_anything_is_looked_up(server: Harness, path: str) -> None:
    with httpx.Client(base_url=server.url, timeout=10) as c:
        r = c.post(
            f"/v1/heal/nope/{path}",
            json={"rank": 0, "incarnation": "z", **({"epoch": 1, "completed": 0} if path == "admit" else {})},
            headers={"Authorization": f"Bearer {server.pool_tokens['pool-a']}"},
        )
    assert r.status_code == 403
