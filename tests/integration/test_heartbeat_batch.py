"""POST /v1/heartbeats against a real server on loopback: many workers' beats in one request, item by item.

Each item is a single beat plus ``worker_id`` and that worker's own token; results come back in order, one bad item
never fails the others, the single beat's idempotency (seq) holds per worker, and an item can only beat for the
worker whose token it carries — not for a worker of another pool, whoever sends the batch.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from conftest import Harness, Worker
from dsec.control.schemas import MAX_BATCH_ITEMS


def item(w: Worker, seq: int, **fields: Any) -> dict[str, Any]:
    return {"worker_id": w.id, "token": w.token, "seq": seq, **fields}


def post(server: Harness, items: Any, token: str | None, raw: bytes | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with server.http() as http:
        if raw is not None:
            return http.post("/v1/heartbeats", content=raw, headers={**headers, "Content-Type": "application/json"})
        return http.post("/v1/heartbeats", json={"items": items}, headers=headers)


def test_items_are_answered_in_order_with_their_directives(server: Harness) -> None:
    ws = [server.register("pool-a", rank=i) for i in range(3)] + [server.register("pool-b")]
    server.admin.set_directive(ws[1].id, compression_bits=8)  # version 2 for ws[1]
    items = [item(w, 1, acked_directive_version=1, metrics={"loss": float(i)}) for i, w in enumerate(ws)]
    resp = post(server, items, ws[0].token)
    assert resp.status_code == 200
    results = resp.json()["items"]
    assert [r["status"] for r in results] == [200] * 4
    assert [r["seq"] for r in results] == [1] * 4 and not any(r["duplicate"] for r in results)
    # the directive goes back to the one worker whose desired version differs from what it acked
    assert [r["directive"] is not None for r in results] == [False, True, False, False]
    assert results[1]["directive"]["version"] == 2 and results[1]["directive"]["compression_bits"] == 8
    for i, w in enumerate(ws):
        view = server.admin.worker(w.id)
        assert view["last_seq"] == 1 and view["metrics"]["loss"] == float(i)
    # acked in the next batch, as in single beats
    resp = post(server, [item(ws[1], 2, acked_directive_version=2)], ws[1].token)
    assert resp.json()["items"][0]["directive"] is None
    assert server.admin.directive(ws[1].id)["in_sync"] is True
    assert 'dsec_heartbeats_total{pool="pool-a"} 4.0' in server.admin.metrics_text()


def test_a_repeated_seq_is_a_duplicate_and_an_older_one_a_conflict_per_worker(server: Harness) -> None:
    a, b = server.register("pool-a"), server.register("pool-a")
    first = post(server, [item(a, 1, metrics={"x": 1.0}), item(b, 1)], a.token).json()["items"]
    assert [r["duplicate"] for r in first] == [False, False]
    # a retry of the whole batch (its answer was lost) applies nothing twice; b moves on meanwhile
    again = post(server, [item(a, 1, metrics={"x": 99.0}), item(b, 2)], a.token).json()["items"]
    assert [(r["status"], r["duplicate"]) for r in again] == [(200, True), (200, False)]
    assert server.admin.worker(a.id)["metrics"]["x"] == 1.0
    # the same worker twice in one batch: applied in order; then an older seq is a 409 for that item only
    twice = post(server, [item(a, 2), item(a, 3), item(a, 2), item(b, 3)], b.token).json()["items"]
    assert [r["status"] for r in twice] == [200, 200, 409, 200]
    assert twice[2]["index"] == 2 and twice[2]["field"] == "seq" and twice[2]["error"] == "conflict"
    assert server.admin.worker(a.id)["last_seq"] == 3 and server.admin.worker(a.id)["beats"] == 3


def test_one_bad_item_never_fails_the_others(server: Harness) -> None:
    ws = [server.register("pool-a") for _ in range(3)]
    items: list[Any] = [
        item(ws[0], 1),
        item(ws[1], 1, metrics={"loss": "0.5"}),  # a string for a number
        item(ws[2], 1),
        {**item(ws[0], 2), "token": "dsw_made-up"},  # someone else's (or no one's) token
        17,  # not an object
        {"worker_id": ws[1].id, "seq": 1},  # no token
        {**item(ws[2], 2), "extra": 1},  # an unknown field
        {**item(ws[2], 2), "worker_id": "w/../x"},  # not a worker id
        item(ws[1], 1, events=[{"type": "lost"}]),  # a control-plane event type
        {**item(ws[1], 1), "token": "dsw_" + "x" * 300},  # longer than any token
    ]
    resp = post(server, items, ws[0].token)
    assert resp.status_code == 200
    results = resp.json()["items"]
    got = [(r["status"], r.get("index"), r.get("field")) for r in results]
    assert got == [
        (200, None, None),
        (422, 1, "metrics.loss"),
        (200, None, None),
        (403, 3, "Authorization"),
        (422, 4, "item"),
        (401, 5, "token"),
        (422, 6, "extra"),
        (422, 7, "worker_id"),
        (422, 8, "events[0].type"),
        (422, 9, "token"),
    ]
    assert all(r["message"] for r in results if r["status"] != 200)
    assert [server.admin.worker(w.id)["last_seq"] for w in ws] == [1, 0, 1]
    # the body of a bad item is the single-beat route's error body for the same beat, plus status and index
    with server.http() as http:
        single = http.post(f"/v1/workers/{ws[1].id}/heartbeat", json={"seq": 1, "metrics": {"loss": "0.5"}},
                           headers={"Authorization": f"Bearer {ws[1].token}"})  # fmt: skip
    assert single.status_code == 422
    assert {k: v for k, v in results[1].items() if k not in ("status", "index")} == single.json()


def test_an_item_for_a_worker_of_another_pool_is_refused(server: Harness) -> None:
    mine, other = server.register("pool-a"), server.register("pool-b")
    # an agent holding pool-a workers' tokens: it names pool-b's worker with a token it has
    items = [item(mine, 1), {**item(other, 1), "token": mine.token}, item(mine, 2)]
    results = post(server, items, mine.token).json()["items"]
    assert [r["status"] for r in results] == [200, 403, 200]
    assert results[1]["index"] == 1 and results[1]["field"] == "worker_id"
    assert "pool-b" not in results[1]["message"]  # nothing about the other worker's pool
    assert server.admin.worker(other.id)["last_seq"] == 0
    # a pool token cannot stand in for the workers' tokens, as header or as an item's token
    assert post(server, [item(other, 1)], server.pool_tokens["pool-a"]).status_code == 403
    results = post(server, [{**item(other, 1), "token": server.pool_tokens["pool-b"]}], mine.token).json()["items"]
    assert results[0]["status"] == 403


def test_the_request_is_authenticated_before_its_body_is_read(server: Harness) -> None:
    w = server.register("pool-a")
    assert post(server, [item(w, 1)], None).status_code == 401
    for token in ("dsw_made-up", server.pool_tokens["pool-a"], server.admin.create_token(kind="read")):
        resp = post(server, None, token, raw=b"{not json")
        assert resp.status_code == 403, token
    # a known worker's token (the agent sends one of its batch's own) and the admin token get to validation
    assert post(server, None, w.token, raw=b"{not json").json()["field"] == "body"
    assert post(server, None, server.admin_token, raw=b"[]").status_code == 422
    assert post(server, None, w.token, raw=b'{"items": 3}').json()["field"] == "items"
    assert post(server, None, w.token, raw=b'{"items": [], "x": 1}').json()["field"] == "x"
    assert post(server, [], w.token).json() == {"items": []}


def test_the_batch_size_is_bounded(server: Harness) -> None:
    w = server.register("pool-a")
    tiny = {"worker_id": w.id, "token": "t", "seq": 1}
    resp = post(server, [tiny] * (MAX_BATCH_ITEMS + 1), w.token)
    assert resp.status_code == 422 and resp.json()["field"] == "items"
    assert str(MAX_BATCH_ITEMS) in resp.json()["message"]
    # the body cap applies as to every route (64 KiB in tests): 413 naming the limit
    big = [item(w, 1, metrics={f"m{i}": 1.0 for i in range(400)})] * 20
    resp = post(server, big, w.token)
    assert resp.status_code == 413 and str(server.settings.max_body_bytes) in resp.json()["message"]
    assert server.admin.worker(w.id)["last_seq"] == 0


@pytest.mark.parametrize("shortcut", [True, False])
def test_items_with_events_are_committed_and_answered_together(
    server_factory: Any, tmp_path: Any, shortcut: bool
) -> None:
    from conftest import make_settings

    h = server_factory(settings=make_settings(tmp_path / "h", heartbeat_shortcut=shortcut), pools=True)
    ws = [h.register("pool-a", rank=i) for i in range(20)]
    ev = [{"type": "log", "data": {"msg": "hello"}}]
    items = [item(w, 1, events=ev if i % 3 == 0 else []) for i, w in enumerate(ws)]
    results = post(h, items, ws[0].token).json()["items"]
    assert [r["status"] for r in results] == [200] * 20
    logged = {e["worker_id"] for e in h.admin.all_events(types=["log"])}
    assert logged == {w.id for i, w in enumerate(ws) if i % 3 == 0}
