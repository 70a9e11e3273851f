"""The telemetry contract over real heartbeats: a real probe's memory growth reaches the control plane, and a
metric a worker stopped sending leaves its metrics and the quota planning (metric_max_age_beats)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import Harness, make_settings, wait_for
from dsec import telemetry
from dsec.control.judge import JudgeConfig
from dsec.probe.config import ProbeConfig
from dsec.probe.memory import MemoryTrend
from dsec.probe.runtime import Probe

GROWTH = telemetry.MEMORY_GROWTH_GB_PER_H.name
USED = telemetry.MEMORY_USED_GB.name


def _worker(h: Harness, worker_id: str) -> dict[str, Any]:
    return next(w for w in h.admin.workers() if w["id"] == worker_id)


def test_the_probe_reports_memory_growth_through_its_heartbeats(server: Harness) -> None:
    env = {"DSEC_ENDPOINT": server.url, "DSEC_SANDBOX_ID": "pool-a", "DSEC_TOKEN": server.pool_tokens["pool-a"],
           "DSEC_HEARTBEAT_INTERVAL": "0.05"}  # fmt: skip
    cfg = ProbeConfig.from_env(env)
    assert cfg is not None
    probe = Probe(cfg)
    # Each beat stands for 30 s of a process leaking 3 GB/h (its clock and its memory are the seams).
    beats = itertools.count()
    probe.memory_trend = MemoryTrend(clock=lambda: 30.0 * next(beats))
    readings = itertools.count()
    probe.memory_source = lambda: {USED: 2.0 + 3.0 * 30.0 * next(readings) / 3600}
    try:
        rep = probe.start()
        wait_for(lambda: rep.worker_id, what="registered")
        m = wait_for(lambda: (w := _worker(server, str(rep.worker_id)))["metrics"].get(GROWTH) and w["metrics"],
                     what="memory_growth_gb_per_h in the worker's metrics")  # fmt: skip
        assert m[GROWTH] == pytest.approx(3.0)
        assert m[USED] > 2.0
    finally:
        probe.close()


def test_a_metric_no_longer_sent_leaves_the_worker_and_the_quota_planning(
    server_factory: Callable[..., Harness], tmp_path: Path
) -> None:
    settings = make_settings(tmp_path, judge=JudgeConfig(quota_interval_s=0.01), metric_max_age_beats=2)
    h = server_factory(settings=settings)
    h.admin.request("PUT", "/v1/devices/gpu-0", json={"id": "gpu-0", "node": "n", "memory_gb": 8.0, "pool": "q"})
    h.admin.put_pool("q", devices=["gpu-0"], memory_base_gb=2, memory_ceiling_gb=4)
    w = h.register("q", token=h.admin.create_token("q"))
    c = h.client(w.token)

    def used_in_plan() -> float | None:
        pool = next(p for p in h.admin.status()["pools"] if p["name"] == "q")
        return (pool["memory"] or {}).get("used_gb")  # None before the first plan

    c.heartbeat(w.id, 1, metrics={USED: 1.5, "updates_total": 1.0})
    wait_for(lambda: used_in_plan() == 1.5, what="the quota plan reading memory_used_gb")
    for seq in (2, 3):  # max_age beats without it: still the worker's latest figure
        c.heartbeat(w.id, seq, metrics={"updates_total": float(seq)})
    assert _worker(h, w.id)["metrics"] == {USED: 1.5, "updates_total": 3.0}
    c.heartbeat(w.id, 4, metrics={"updates_total": 4.0})
    assert _worker(h, w.id)["metrics"] == {"updates_total": 4.0}
    wait_for(lambda: used_in_plan() == 0.0, what="the quota plan without the stale memory figure")
    c.heartbeat(w.id, 5, metrics={USED: 2.5})  # sent again: back
    assert _worker(h, w.id)["metrics"][USED] == 2.5
