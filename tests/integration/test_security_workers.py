"""What a hostile worker (a worker token, and the pool token its probe was given) can no longer do, against a real
control plane on loopback (docs/security.md, findings 1, 3, 6, 7 and 12)."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import Harness, Worker, http_receiver, make_settings, start_harness, wait_for
from dsec.alerts.signing import SIGNATURE_HEADER, TIMESTAMP_HEADER, sign
from dsec.client import ApiError, Client
from dsec.control.app import create_app
from dsec.control.server import ServerThread

REPO = Path(__file__).resolve().parents[2]


def beat(h: Harness, w: Worker, seq: int, **body: Any) -> httpx.Response:
    with h.http() as http:
        return http.post(
            f"/v1/workers/{w.id}/heartbeat",
            json={"seq": seq, **body},
            headers={"Authorization": f"Bearer {w.token}"},
        )


def gauge(h: Harness, name: str, pool: str) -> float:
    for line in h.admin.metrics_text().splitlines():
        if line.startswith(f'{name}{{pool="{pool}"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} for {pool} not exposed")


# -- finding 1: metric names accumulate across beats -----------------------------------------------------------------
def test_distinct_metric_names_per_worker_are_bounded(server: Harness) -> None:
    w = server.register("pool-a")
    for seq in (1, 2):  # 256 new names per beat: the default cap of 512 exactly
        names = {f"m{seq}_{i}": float(i) for i in range(256)}
        assert beat(server, w, seq, metrics=names).status_code == 200
    third = beat(server, w, 3, metrics={"m1_0": 1.0, "one_more": 1.0})
    assert third.status_code == 422, third.text
    assert third.json()["field"] == "metrics" and "at most 512" in third.json()["message"]
    view = server.admin.worker(w.id)
    assert len(view["metrics"]) == 512 and view["last_seq"] == 2, "the refused beat applied nothing"
    assert view["metrics"]["m1_0"] == 0.0
    # Names it already holds keep updating: the cap bounds new names, not reports.
    again = beat(server, w, 3, metrics={"m1_0": 42.0, "m2_255": 7.0})
    assert again.status_code == 200 and server.admin.worker(w.id)["metrics"]["m1_0"] == 42.0
    # The same for as many beats as the worker likes: 500 beats of fresh names no longer accumulate.
    for seq in range(4, 14):
        assert beat(server, w, seq, metrics={f"fresh{seq}_{i}": 1.0 for i in range(512)}).status_code == 422
    assert len(server.admin.worker(w.id)["metrics"]) == 512


# -- finding 3: a pool token and another pool's device ---------------------------------------------------------------
def test_a_pool_token_registers_only_on_its_own_pools_devices(server: Harness) -> None:
    for dev, pool in (("gpu-a0", "pool-a"), ("gpu-b0", "pool-b")):
        server.admin.request("PUT", f"/v1/devices/{dev}", json={"id": dev, "node": "n0", "pool": pool})
        server.admin.put_pool(pool, devices=[dev])
    with pytest.raises(ApiError) as info:
        server.register("pool-a", device="gpu-b0")
    assert info.value.status == 403 and info.value.field == "device"
    assert "pool-b" not in info.value.message, "the refusal must not say whose device it is"
    assert not [w for w in server.admin.workers() if w["device"] == "gpu-b0"]
    # Its own device, and a device the inventory does not know (a launcher's local name), are fine.
    assert server.register("pool-a", device="gpu-a0").answer["worker_id"]
    assert server.register("pool-a", device="cuda:0").answer["worker_id"]
    # An admin token is trusted to place anything anywhere.
    assert server.register("pool-a", token=server.admin_token, device="gpu-b0").answer["worker_id"]


# -- finding 6: worker figures that steer pool-wide decisions --------------------------------------------------------
def test_restore_time_out_of_range_is_refused(server: Harness) -> None:
    w = server.register("pool-a")
    r = beat(server, w, 1, events=[{"type": "restore", "data": {"restore_s": 9999}}])
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "events[0].data" and "restore_s" in r.json()["message"]
    assert server.admin.worker(w.id)["last_seq"] == 0
    assert not server.admin.all_events(worker_id=w.id, types=["restore"])


@pytest.mark.parametrize(
    ("metrics", "name"),
    [
        ({"memory_used_gb": -1.0}, "memory_used_gb"),
        ({"memory_used_gb": 1e9}, "memory_used_gb"),
        ({"sync_ops_total": -5.0}, "sync_ops_total"),
        ({"sync_ops_total": 10.0, "sync_ok_total": 1e15}, "sync_ok_total"),
    ],
)
def test_figures_feeding_pool_gauges_must_be_plausible(server: Harness, metrics: dict[str, float], name: str) -> None:
    w = server.register("pool-a")
    r = beat(server, w, 1, metrics=metrics)
    assert r.status_code == 422 and r.json()["field"] == "metrics" and name in r.json()["message"], r.text
    assert server.admin.worker(w.id)["metrics"] == {}


SLOW_RECOVERY_POLICY = (REPO / "examples/policies/slow-recovery-more-compression.yaml").read_text()


def test_one_worker_cannot_move_its_pools_recovery_time(server_factory: Callable[..., Harness], tmp_path: Path) -> None:
    h = server_factory(settings=make_settings(tmp_path / "h", policy_interval_s=0.1), pools=True)
    h.admin.put_policies(SLOW_RECOVERY_POLICY)
    workers = [h.register("pool-a") for _ in range(3)]
    sent = time.time()
    assert beat(h, workers[0], 1, events=[{"type": "restore", "data": {"restore_s": 3000.0}}]).status_code == 200
    assert math.isnan(gauge(h, "dsec_snapshot_recovery_time", "pool-a")), "one reporter of three moves nothing"

    def sampled_since_report() -> bool:
        # A gauge without a value (NaN: too few reporters) is no sample in the policy history, so watch another
        # of the pool's gauges for the sampler having run since the report.
        for s in h.admin.metric_series()["series"]:
            if s["metric"] == "dsec_workers_active" and s["labels"]["pool"] == "pool-a":
                return any(t > sent for t, _ in s["samples"])
        return False

    wait_for(sampled_since_report, what="the policy engine sampling after the report")
    assert not h.admin.all_events(types=["policy_action"], pool="pool-a")
    assert next(p for p in h.admin.pools() if p["name"] == "pool-a")["snapshot_compression_level"] == 2
    # Corroborated by a second worker: the lower median of the two, which no minority can raise.
    assert beat(h, workers[1], 1, events=[{"type": "restore", "data": {"restore_s": 0.5}}]).status_code == 200
    assert gauge(h, "dsec_snapshot_recovery_time", "pool-a") == pytest.approx(0.5)
    (ev,) = h.admin.all_events(worker_id=workers[0].id, types=["restore"])
    assert ev["data"]["source"] == "worker"


def test_a_workers_alert_reaches_the_alert_webhook_attributed(tmp_path: Path) -> None:
    secret = "alert-secret-0123456789"
    received: list[tuple[dict[str, str], bytes]] = []
    got = threading.Event()

    def handle(headers: dict[str, str], body: bytes) -> tuple[int, dict[str, str], bytes]:
        received.append((headers, body))
        got.set()
        return 200, {}, b"{}"

    with http_receiver(handle) as url:
        settings = make_settings(tmp_path / "h", alert_webhooks=((url, secret),), alert_group_wait_s=0.05)
        h = start_harness(settings, pools=True)
        try:
            w = h.register("pool-a")
            forged = {"name": "pool-a_pool_sync_slowdown", "severity": "critical", "summary": "all clear, ignore",
                      "source": "control_plane"}  # fmt: skip
            assert beat(h, w, 1, events=[{"type": "alert", "data": forged}]).status_code == 200
            assert got.wait(10), "no alert notification arrived"
        finally:
            h.close()
    headers, body = received[0]
    headers = {k.lower(): v for k, v in headers.items()}
    assert headers[SIGNATURE_HEADER.lower()] == sign(secret, int(headers[TIMESTAMP_HEADER.lower()]), body)
    (alert,) = json.loads(body)["alerts"]
    assert alert["name"] == "worker_reported_pool_a_pool_sync_slowdown"
    assert alert["severity"] == "warning" and alert["labels"] == {"source": "worker"}
    assert alert["summary"] == f"reported by worker {w.id}: all clear, ignore"


# -- finding 7: quotas and retention ---------------------------------------------------------------------------------
def test_registrations_per_pool_token_are_bounded(server_factory: Callable[..., Harness], tmp_path: Path) -> None:
    h = server_factory(settings=make_settings(tmp_path / "h", max_workers_per_token=3), pools=True)
    ws = [h.register("pool-a") for _ in range(3)]
    with pytest.raises(ApiError) as info:
        h.register("pool-a")
    assert info.value.status == 429 and info.value.code == "quota_exceeded"
    assert len(h.admin.workers(pool="pool-a")) == 3
    h.admin.deregister(ws[0].id, token=ws[0].token)
    assert h.register("pool-a").answer["worker_id"], "a deregistered worker frees its place"
    other = h.admin.create_token("pool-a")
    assert h.register("pool-a", token=other).answer["worker_id"], "the quota is per token"


def test_events_beyond_a_workers_budget_are_refused_and_can_be_resent(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    settings = make_settings(tmp_path / "h", worker_events_per_s=0.001, worker_events_burst=10)
    h = server_factory(settings=settings, pools=True)
    w = h.register("pool-a")
    logs = [{"type": "log", "data": {"i": i}} for i in range(8)]
    assert beat(h, w, 1, events=logs).status_code == 200
    r = beat(h, w, 2, events=logs)
    assert r.status_code == 429 and r.json()["field"] == "events", r.text
    assert r.headers.get("content-type") == "application/json"
    assert h.admin.worker(w.id)["last_seq"] == 1, "nothing of the refused beat was applied"
    assert beat(h, w, 2, events=logs[:2]).status_code == 200, "the same seq goes through within the budget"
    assert len(h.admin.all_events(worker_id=w.id, types=["log"])) == 10


def test_worker_chosen_event_times_are_bounded(server: Harness) -> None:
    w = server.register("pool-a")
    before = time.time()
    events = [{"type": "log", "ts": 0, "data": {"k": "zero"}}, {"type": "log", "ts": 4e9, "data": {"k": "future"}},
              {"type": "log", "ts": before - 10, "data": {"k": "recent"}}]  # fmt: skip
    assert beat(server, w, 1, events=events).status_code == 200
    got = {e["data"]["k"]: e for e in server.admin.all_events(worker_id=w.id, types=["log"])}
    for k, sent in (("zero", 0), ("future", 4e9)):
        assert before <= got[k]["ts"] <= time.time() and got[k]["data"]["worker_ts"] == sent
    assert got["recent"]["ts"] == pytest.approx(before - 10) and "worker_ts" not in got["recent"]["data"]


class Clock:
    """A clock the test moves (the control plane's clock seam)."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def test_deregistered_workers_and_old_events_are_forgotten(tmp_path: Path) -> None:
    clock = Clock()
    settings = make_settings(tmp_path / "h", worker_retention_s=600, event_retention_s=3600, retention_interval_s=0.01)
    with ServerThread(create_app(settings, clock=clock)) as srv, Client(srv.url, token=settings.admin_token) as c:
        c.put_pool("pool-a")
        token = c.create_token("pool-a")
        gone = c.register("pool-a", token=token)
        stays = c.register("pool-a", token=token)
        c.heartbeat(gone["worker_id"], 1, events=[{"type": "log", "data": {"n": 1}}], token=gone["worker_token"])
        c.deregister(gone["worker_id"], token=gone["worker_token"])
        clock.now += 601  # past worker retention, not yet event retention
        wait_for(lambda: gone["worker_id"] not in {w["id"] for w in c.workers()}, what="the eviction")
        with pytest.raises(ApiError) as info:
            c.worker(gone["worker_id"])
        assert info.value.status == 404
        assert {w["id"] for w in c.workers()} == {stays["worker_id"]}, "an active worker stays"
        assert c.all_events(worker_id=gone["worker_id"], types=["log"]), "events outlive their worker"
        with pytest.raises(ApiError) as info:  # its token went with it
            c.heartbeat(gone["worker_id"], 2, token=gone["worker_token"])
        assert info.value.status == 403
        clock.now += 3600
        wait_for(lambda: not c.all_events(types=["log"]), what="old events pruned")
        assert c.all_events(types=["pool_changed"]) == [] and c.all_events(types=["registered"]) == []
    # Forgotten in the store too: a control plane started on the same database does not bring it back.
    with ServerThread(create_app(settings, clock=clock)) as srv, Client(srv.url, token=settings.admin_token) as c:
        assert {w["id"] for w in c.workers()} == {stays["worker_id"]}


# -- finding 12: the token before the body ---------------------------------------------------------------------------
def test_a_heartbeat_is_authenticated_before_its_body_is_parsed(server: Harness) -> None:
    w = server.register("pool-a")
    bad_body = b'{"seq": "not a number", "metrics": {"x": NaN'
    with server.http() as http:
        for token in ("dsw_not-a-token", server.pool_tokens["pool-a"]):
            r = http.post(
                f"/v1/workers/{w.id}/heartbeat", content=bad_body, headers={"Authorization": f"Bearer {token}"}
            )
            assert r.status_code == 403, r.text
        r = http.post(f"/v1/workers/{w.id}/heartbeat", content=bad_body)
        assert r.status_code == 401
        r = http.post(f"/v1/workers/{w.id}/heartbeat", content=bad_body, headers={"Authorization": f"Bearer {w.token}"})
        assert r.status_code == 422 and r.json()["field"] == "body"
