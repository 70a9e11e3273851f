"""Degraded-device detection through the real API: workers on four devices beat over HTTP; the one on a slow
device is a fleet outlier on step time -> the device is degraded (event), its worker is asked for a snapshot, its
pool's policy actions are held back, placements avoid it; once empty it goes on probation, and a worker running
cleanly on it through probation makes it healthy again. Run records feed the device profiles, which survive a
control-plane restart."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness, make_settings, wait_for
from dsec.client import ApiError, Client
from dsec.control.judge import JudgeConfig
from dsec.scheduler.device_health import DeviceHealthConfig

FAST = DeviceHealthConfig(degrade_after_s=0.5, probation_after_s=0.5, probation_s=0.5, recovery_hold_s=30)


def start(server_factory: Callable[..., Harness], home: Path, port: int | None = None) -> Harness:
    settings = make_settings(home, device_health=FAST, judge=JudgeConfig(fleet_interval_s=0.1))
    h = server_factory(settings=settings, port=port, pools=False)
    return h


def four_devices(h: Harness) -> str:
    """Devices gpu-0..3 on one node, all in pool-a; returns a worker-registration token for the pool."""
    for i in range(4):
        h.admin.request("PUT", f"/v1/devices/gpu-{i}", json={"id": f"gpu-{i}", "node": "node-0", "memory_gb": 16,
                                                             "pool": "pool-a"})  # fmt: skip
    h.admin.put_pool("pool-a", devices=[f"gpu-{i}" for i in range(4)])
    return str(h.admin.create_token("pool-a"))


class Worker:
    def __init__(self, h: Harness, token: str, device: str, role: str = "learner") -> None:
        answer = h.admin.register("pool-a", token=token, role=role, device=device, heartbeat_interval_s=1.0)
        self.id = answer["worker_id"]
        self.client: Client = h.client(answer["worker_token"])
        self.seq = 0
        self.version = int(answer["directive"]["version"])

    def beat(self, step_ms: float, **extra: float) -> dict[str, Any]:
        self.seq += 1
        metrics = {"step_ms_mean": step_ms, "updates_total": float(self.seq), **extra}
        a = self.client.heartbeat(self.id, self.seq, acked_directive_version=self.version, metrics=metrics)
        if a["directive"] is not None:
            self.version = int(a["directive"]["version"])
        return a


def device_events(h: Harness) -> list[tuple[str, str, str]]:
    evs = h.admin.all_events(types=["device"])
    return [(e["data"]["device"], e["data"]["from"], e["data"]["to"]) for e in evs if e["data"]["kind"] == "health"]


def health(h: Harness, device: str) -> str:
    return next(d["health"] for d in h.admin.devices() if d["id"] == device)


def test_slow_device_degrades_then_probation_then_healthy(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    h = start(server_factory, tmp_path / "cp")
    token = four_devices(h)
    workers = [Worker(h, token, f"gpu-{i}") for i in range(4)]
    slow = workers[2]

    def beat_all(slow_ms: float = 400.0) -> bool:
        for w in workers:
            w.beat(slow_ms if w is slow else 100.0)
        return True

    def degraded() -> bool:
        beat_all()
        return health(h, "gpu-2") == "degraded"

    wait_for(degraded, timeout=15, interval=0.1, what="gpu-2 degraded")
    assert device_events(h) == [("gpu-2", "healthy", "degraded")]
    (ev,) = [e for e in h.admin.all_events(types=["device"]) if e["data"]["kind"] == "health"]
    assert "step_ms_mean" in ev["data"]["flags"][slow.id]
    # Its worker is asked for a snapshot (the launcher moves it from there); the others are not.
    snap_now = slow.beat(400.0)["directive"] or h.admin.request("GET", f"/v1/workers/{slow.id}/directive")
    assert str(h.admin.request("GET", f"/v1/workers/{slow.id}/directive")["desired"]["snapshot_now"]).startswith(
        "degraded-gpu-2-"
    ), snap_now
    assert h.admin.request("GET", f"/v1/workers/{workers[0].id}/directive")["desired"]["snapshot_now"] is None
    # Placements avoid it now.
    job = {"name": "j", "pool": "pool-a", "groups": [{"name": "g", "workers": [{"name": "a", "memory_gb": 1}]}]}
    p = h.admin.place(job)
    assert p["excluded"]["gpu-2"] == "device is degraded" and p["assignments"][0]["device"] != "gpu-2"
    h.admin.release_placement("j")
    # The worker moves away (deregisters): the device is empty -> probation after probation_after_s.
    slow.client.deregister(slow.id)
    workers.remove(slow)
    wait_for(lambda: beat_all() and health(h, "gpu-2") == "probation", timeout=10, interval=0.1, what="probation")
    # Probation devices are placeable, last in line.
    p = h.admin.place(
        {**job, "groups": [{"name": "g", "workers": [{"name": f"w{i}", "memory_gb": 1} for i in range(4)]}]}
    )
    on_probation = next(a for a in p["assignments"] if a["device"] == "gpu-2")
    assert on_probation["terms"]["probation"] < 0
    h.admin.release_placement("j")
    # A worker runs cleanly on it through probation -> healthy.
    newcomer = Worker(h, token, "gpu-2")
    workers.append(newcomer)
    wait_for(lambda: beat_all() and health(h, "gpu-2") == "healthy", timeout=10, interval=0.1, what="readmission")
    assert device_events(h) == [
        ("gpu-2", "healthy", "degraded"), ("gpu-2", "degraded", "probation"), ("gpu-2", "probation", "healthy")
    ]  # fmt: skip
    # The run that ended on gpu-2 is in its profile; profiles survive a restart (rebuilt from events).
    profiles = h.admin.request("GET", "/v1/profiles")["devices"]
    assert any(p["device"] == "gpu-2" and p["runs"] == 1 for p in profiles)
    port = h.port
    h.close()
    h2 = start(server_factory, tmp_path / "cp", port=port)
    assert h2.admin.request("GET", "/v1/profiles")["devices"] == profiles
    assert health(h2, "gpu-2") == "healthy"


def test_a_worker_slow_only_at_sync_is_flagged_but_its_device_is_not_degraded(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    """A slow link (or a late peer) makes a worker's syncs slow, not its compute, and follows the worker wherever it
    is placed: the fleet comparison flags the worker, device health does not blame its card. Then the same worker's
    compute slows down (compute_ms_p50): now the card is degraded."""
    h = start(server_factory, tmp_path / "cp")
    token = four_devices(h)
    workers = [Worker(h, token, f"gpu-{i}") for i in range(4)]
    far = workers[1]

    def beat_all(compute_slow: bool = False) -> None:
        for w in workers:
            sync = 400.0 if w is far else 20.0
            compute = 400.0 if w is far and compute_slow else 100.0
            w.beat(5.0, sync_latency_ms_p50=sync, sync_lag_ms_p50=sync / 2, compute_ms_p50=compute)

    def flagged() -> bool:
        beat_all()
        evs = h.admin.all_events(types=["anomaly"], worker_id=far.id)
        return any(e["data"].get("feature") == "sync_latency_ms_p50" for e in evs)

    wait_for(flagged, timeout=15, interval=0.1, what="the far worker flagged on sync latency")
    for _ in range(15):  # 1.5 s: three times degrade_after_s
        beat_all()
        time.sleep(0.1)
    assert health(h, "gpu-1") == "healthy" and device_events(h) == []

    def degraded() -> bool:
        beat_all(compute_slow=True)
        return health(h, "gpu-1") == "degraded"

    wait_for(degraded, timeout=15, interval=0.1, what="gpu-1 degraded on compute time")
    (ev,) = [e for e in h.admin.all_events(types=["device"]) if e["data"]["kind"] == "health"]
    assert "compute_ms_p50" in ev["data"]["flags"][far.id]


def test_placement_requests_with_repeated_names_are_refused(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    h = start(server_factory, tmp_path / "cp")
    twice = {"name": "j", "groups": [{"name": "g", "workers": [{"name": "a"}, {"name": "a"}]}]}
    with pytest.raises(ApiError) as info:
        h.admin.place(twice)
    assert info.value.status == 422 and info.value.field == "groups" and "a repeated" in info.value.message
    with pytest.raises(ApiError) as info:
        h.admin.place({"name": "j", "pool": "nope", "groups": [{"name": "g", "workers": [{"name": "a"}]}]})
    assert info.value.status == 404 and info.value.field == "pool"
    assert h.admin.request("GET", "/v1/placements")["items"] == []  # nothing was placed or held


def test_pins_in_a_placement_request(server_factory: Callable[..., Harness], tmp_path: Path) -> None:
    h = start(server_factory, tmp_path / "cp")
    four_devices(h)
    h.admin.request("PUT", "/v1/devices/gpu-1", json={"id": "gpu-1", "node": "node-0", "memory_gb": 16,
                                                      "pool": "pool-a", "health": "degraded"})  # fmt: skip
    workers = [{"name": "a", "device": "gpu-1"}, {"name": "b", "device": "gpu-3"}, {"name": "c"}]
    p = h.admin.place({"name": "j", "pool": "pool-a", "groups": [{"name": "g", "workers": workers}]})
    devices = {a["worker"]: a["device"] for a in p["assignments"]}
    # Pinned workers stay (a degraded device included: the caller says its worker runs there), the other goes to a
    # device no pin holds.
    assert p["complete"] and devices == {"a": "gpu-1", "b": "gpu-3", "c": "gpu-0"}, p
    # Another job cannot pin a device this one holds: its worker is unplaced, saying why.
    other = h.admin.place({"name": "k", "pool": "pool-a", "groups": [{"name": "g2", "workers": [
        {"name": "x", "device": "gpu-3"}]}]})  # fmt: skip
    assert other["unplaced"] == {"x": "pinned to gpu-3: a worker of another job runs there"}
    bad_requests = [
        ([{"name": "a", "device": "gpu-9"}], "groups[0].workers[0].device", "no device 'gpu-9'"),
        ([{"name": "a"}, {"name": "b", "device": "gpu-9"}], "groups[0].workers[1].device", "no device 'gpu-9'"),
        ([{"name": "a", "device": "gpu-2"}, {"name": "b", "device": "gpu-2"}], "groups", "gpu-2 pinned more than once"),
    ]
    for ws, field, message in bad_requests:
        with pytest.raises(ApiError) as info:
            h.admin.place({"name": "j", "pool": "pool-a", "groups": [{"name": "g", "workers": ws}]})
        assert info.value.status == 422 and info.value.field == field and message in info.value.message, info.value
    assert h.admin.placement("j")["assignments"] == p["assignments"]  # a refused request changed nothing
    # complete_only: a placement that would leave a worker unplaced is a 409 naming it, and is not recorded.
    more = [*workers, {"name": "d"}, {"name": "e"}]  # five workers, four devices
    with pytest.raises(ApiError) as info:
        h.admin.place({"name": "j", "pool": "pool-a", "groups": [{"name": "g", "workers": more}]}, complete_only=True)
    assert info.value.status == 409 and "cannot be placed whole" in info.value.message, info.value
    assert h.admin.placement("j")["assignments"] == p["assignments"]
    assert not h.admin.place({"name": "j", "pool": "pool-a", "groups": [{"name": "g", "workers": more}]})["complete"]


def test_a_learner_without_peers_does_not_shield_its_slow_device(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    """IMPALA-style: one learner, several actors. The learner cannot be compared (fewer than 3 learners), so it
    neither counts for nor against its device: the device it shares with a slow actor is degraded all the same."""
    h = start(server_factory, tmp_path / "cp")
    token = four_devices(h)
    actors = [Worker(h, token, f"gpu-{i}", role="actor") for i in range(4)]
    learner = Worker(h, token, "gpu-2", role="learner")
    slow = actors[2]

    def degraded() -> bool:
        for w in actors:
            w.beat(400.0 if w is slow else 100.0)
        learner.beat(100.0)
        return health(h, "gpu-2") == "degraded"

    wait_for(degraded, timeout=15, interval=0.1, what="gpu-2 degraded although its learner was not judged")
    assert device_events(h) == [("gpu-2", "healthy", "degraded")]
    assert all(health(h, f"gpu-{i}") == "healthy" for i in (0, 1, 3))
