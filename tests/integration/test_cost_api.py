"""Cost accounting against a real control plane on loopback: workers beat over HTTP, one of them slow enough to
melt down; ``GET /v1/cost`` splits the device-hours so that the phases add up to the total and the degraded period
shows up as degraded hours; a bad window is a 422 naming the field; the gauges and ``dsec cost`` show the same."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from conftest import Harness, make_settings, wait_for
from dsec.breaker import BreakerConfig
from dsec.cli import app
from dsec.client import ApiError
from dsec.control.judge import JudgeConfig

FAST_BREAKER = BreakerConfig(window_s=0.5, min_samples=3, recovery_s=30.0, max_recovery_s=60.0)
PRICE = 2.5


class Fleet:
    """Workers beating from the test thread with their own tokens, acking each directive as the probe does."""

    def __init__(self, h: Harness, workers: list[dict[str, Any]]) -> None:
        self.clients = {w["worker_id"]: h.client(w["worker_token"]) for w in workers}
        self.acked = {w["worker_id"]: int(w["directive"]["version"]) for w in workers}
        self.seq = dict.fromkeys(self.acked, 0)
        self.slow: set[str] = set()

    def beat(self) -> None:
        for wid, c in self.clients.items():
            self.seq[wid] += 1
            i = self.seq[wid]
            cost = 200.0 if wid in self.slow else 8.0
            metrics = {
                "sync_cost_ms_p50": cost,
                "sync_latency_ms_p50": cost + 4.0,
                "sync_ops_total": 20.0 * i,
                "sync_ok_total": 20.0 * i,
                "updates_total": 10.0 * i,
                "step_ms_mean": 50.0,
            }
            events = []
            if i % 5 == 0:
                data = {"status": "ok", "step": 10 * i, "bytes": 1 << 20, "stage_ms": 3.0, "total_ms": 40.0}
                events = [{"type": "snapshot", "data": {**data, "blocking_ms": 1.0}}]
            answer = c.heartbeat(wid, i, acked_directive_version=self.acked[wid], metrics=metrics, events=events)
            if answer.get("directive"):
                self.acked[wid] = int(answer["directive"]["version"])

    def run(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.beat()
            time.sleep(0.05)


@pytest.fixture
def cp(server_factory: Callable[..., Harness], tmp_path: Path) -> Harness:
    settings = make_settings(
        tmp_path / "cp", judge=JudgeConfig(breaker=FAST_BREAKER), cost_device_hour=PRICE, cost_refresh_s=0.2
    )
    return server_factory(settings=settings, pools=True)


def _pool(report: dict[str, Any], name: str) -> dict[str, Any]:
    return next(p for p in report["pools"] if p["pool"] == name)


def test_cost_splits_device_hours_and_a_meltdown_shows_as_degraded(cp: Harness) -> None:
    t0 = time.time()
    slow = cp.register("pool-a", device="gpu-0", group="ppo").answer
    steady = cp.register("pool-a", device="gpu-1", group="ppo").answer
    other = cp.register("pool-b").answer  # no device: one is assumed, and the report says so
    fleet = Fleet(cp, [slow, steady, other])
    fleet.run(1.0)
    fleet.slow.add(slow["worker_id"])
    deadline = time.monotonic() + 20
    while not cp.admin.events(worker_id=slow["worker_id"], types=["meltdown"])["items"]:
        assert time.monotonic() < deadline, "no meltdown"
        fleet.run(0.2)
    fleet.run(1.5)  # degraded for a while

    read = cp.client(cp.admin.create_token(kind="read"))
    report = read.cost(since=t0 - 1)
    span_h = (time.time() - t0 + 1) / 3600
    a = _pool(report, "pool-a")
    h = a["device_hours"]
    assert h["total"] == pytest.approx(h["useful"] + h["degraded"] + h["recovering"] + h["idle"], rel=1e-9)
    assert 0 < h["total"] <= 2 * span_h
    # the slow worker's degraded stretch: at least the 1.5 s it beat after the meltdown
    assert h["degraded"] >= 1.4 / 3600, h
    assert h["useful"] > 0 and h["idle"] == 0
    assert a["cost"]["total"] == pytest.approx(PRICE * h["total"])
    assert a["groups"]["ppo"]["device_hours"]["degraded"] == pytest.approx(h["degraded"])
    assert a["implicit"]["snapshots"]["count"] >= 2 and a["implicit"]["snapshots"]["bytes"] >= 2 << 20
    assert a["opportunity"]["degraded_steps"] > 0  # estimated from step_ms_mean
    assert any(e.startswith("degraded_steps") for e in report["estimated"])
    assert any(e.startswith("devices: 1 worker") for e in report["estimated"])  # pool-b's worker
    total = report["device_hours"]
    assert total["total"] == pytest.approx(sum(p["device_hours"]["total"] for p in report["pools"]))
    assert report["implicit"]["process"]["cpu_s"] > 0 and report["implicit"]["process"]["rss_bytes"] > 0
    assert report["implicit"]["probe_overhead_ms_per_step"] is None

    only_b = read.cost(pool="pool-b", since=t0 - 1)
    assert [p["pool"] for p in only_b["pools"]] == ["pool-b"]
    assert only_b["pools"][0]["device_hours"]["degraded"] == 0

    # the gauges: the last hour's report, recomputed by the reconcile loop
    def degraded_gauge() -> float:
        for line in cp.admin.metrics_text().splitlines():
            if line.startswith('dsec_cost_device_seconds{phase="degraded",pool="pool-a"}'):
                return float(line.split()[-1])
        return 0.0

    wait_for(lambda: degraded_gauge() > 0, timeout=10, what="dsec_cost_device_seconds degraded > 0")

    env = {"DSEC_ENDPOINT": cp.url, "DSEC_ADMIN_TOKEN": cp.admin_token, "COLUMNS": "100"}
    out = CliRunner().invoke(app, ["cost", "--since", "600", "--json"], env=env)
    assert out.exit_code == 0, out.output
    parsed = json.loads(out.output)
    assert _pool(parsed, "pool-a")["device_hours"]["degraded"] > 0
    table = CliRunner().invoke(app, ["cost", "--since", "600"], env=env)
    assert table.exit_code == 0, table.output
    assert "pool-a" in table.output and "degraded" in table.output
    assert all(len(line) <= 100 for line in table.output.splitlines()), table.output
    wide = CliRunner().invoke(app, ["cost", "--since", "600", "--wide"], env=env)
    assert wide.exit_code == 0 and "ppo" in wide.output


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"since": 100.0, "until": 50.0}, "until"),
        ({"since": 100.0, "until": 100.0}, "until"),
        ({"since": 1e12}, "since"),  # after now, with until defaulting to now
        ({"until": 0.0}, "until"),
        ({"since": -1.0}, "since"),
    ],
)
def test_a_bad_window_is_a_422_naming_the_field(cp: Harness, params: dict[str, float], field: str) -> None:
    with pytest.raises(ApiError) as e:
        cp.admin.cost(**params)
    assert e.value.status == 422 and e.value.field == field, e.value


def test_the_cli_refuses_an_empty_window() -> None:
    out = CliRunner().invoke(app, ["cost", "--since", "10", "--until", "20"], env={"COLUMNS": "100"})
    assert out.exit_code == 2 and "--until" in out.output


def test_a_lost_worker_recovers_and_a_worker_without_progress_idles(cp: Harness) -> None:
    t0 = time.time()
    flaky = cp.register("pool-a", device="gpu-0", heartbeat_interval_s=0.1)
    waiting = cp.register("pool-b", device="gpu-1", heartbeat_interval_s=5.0)
    fc, wc = cp.client(flaky.token), cp.client(waiting.token)
    seq = 0

    def beat() -> None:
        nonlocal seq
        seq += 1
        fc.heartbeat(flaky.id, seq, acked_directive_version=1, metrics={"updates_total": float(seq)})

    for _ in range(5):
        beat()
        time.sleep(0.05)
    wc.heartbeat(waiting.id, 1, acked_directive_version=1, metrics={"memory_used_gb": 1.0})  # no progress
    wait_for(lambda: cp.admin.worker(flaky.id)["state"] == "lost", timeout=10, what="the flaky worker lost")
    time.sleep(0.5)
    beat()  # rejoins
    assert cp.admin.worker(flaky.id)["state"] == "active"
    report = cp.admin.cost(since=t0 - 1)
    a, b = _pool(report, "pool-a")["device_hours"], _pool(report, "pool-b")["device_hours"]
    assert a["recovering"] * 3600 >= 0.45, a
    assert a["total"] == pytest.approx(a["useful"] + a["recovering"], rel=1e-9) and a["degraded"] == a["idle"] == 0
    assert b["idle"] > 0 and b["idle"] == pytest.approx(b["total"], rel=1e-9)
