"""Cost accounting (dsec.cost) against hand-computed fixtures: phases, totals, prices, overhead, effects."""

from __future__ import annotations

import math
from typing import Any

import pytest

from dsec.cost import (
    ProcessUsage,
    Segment,
    Window,
    WindowError,
    WorkerRecord,
    account,
    diff_ci,
    mean_ci,
    recovery_comparison,
    snapshot_overhead,
    worker_segments,
)
from dsec.model import Event, EventType

H = 3600.0


def ev(ts: float, etype: EventType, worker: str | None = "w1", pool: str | None = "p", **data: Any) -> Event:
    return Event(ts=ts, type=etype, worker_id=worker, pool=pool, data=data)


def level(ts: float, to: int, worker: str = "w1") -> Event:
    etype = EventType.MELTDOWN if to == 1 else EventType.RECOVERED if to == 0 else EventType.BREAKER
    return ev(ts, etype, worker, level_to=to)


def phases(segs: list[Segment]) -> list[tuple[float, float, str]]:
    return [(s.start, s.end, s.phase) for s in segs]


def test_window_refuses_bad_bounds_naming_the_field() -> None:
    with pytest.raises(WindowError) as e:
        Window(10.0, 10.0)
    assert e.value.field == "until"
    with pytest.raises(WindowError) as e:
        Window(-1.0, 10.0)
    assert e.value.field == "since"
    with pytest.raises(WindowError) as e:
        Window(0.0, math.inf)
    assert e.value.field == "until"


def test_a_meltdown_and_recovery_split_useful_and_degraded() -> None:
    w = WorkerRecord("w1", "p", registered_at=0.0, device="d0", devices=1)
    events = [ev(0, EventType.REGISTERED), level(1000, 1), level(1500, 2), level(2000, 0)]
    segs = worker_segments(w, events, Window(0, H))
    assert phases(segs) == [
        (0, 1000, "useful"),
        (1000, 1500, "degraded"),
        (1500, 2000, "degraded"),
        (2000, H, "useful"),
    ]
    assert [s.level for s in segs] == [0, 1, 2, 0]


def test_state_before_the_window_carries_in_and_the_end_clips() -> None:
    # Degraded since before the window; deregistered inside it.
    w = WorkerRecord("w1", "p", registered_at=0.0, devices=2)
    events = [level(100, 1), ev(5000, EventType.DEREGISTERED)]
    segs = worker_segments(w, events, Window(3600, 7200))
    assert phases(segs) == [(3600, 5000, "degraded")]


def test_lost_until_rejoined_is_recovering() -> None:
    w = WorkerRecord("w1", "p", registered_at=0.0, devices=1)
    events = [ev(600, EventType.LOST), ev(900, EventType.REJOINED)]
    assert phases(worker_segments(w, events, Window(0, 1200))) == [
        (0, 600, "useful"),
        (600, 900, "recovering"),
        (900, 1200, "useful"),
    ]


def test_a_lost_worker_stops_holding_its_device_when_another_registers_on_it() -> None:
    w = WorkerRecord("w1", "p", registered_at=0.0, device="d0", devices=1)
    segs = worker_segments(w, [ev(600, EventType.LOST)], Window(0, 1200), handovers=[800.0])
    assert phases(segs) == [(0, 600, "useful"), (600, 800, "recovering")]


def test_a_restoring_worker_recovers_from_registration_to_its_restore() -> None:
    w = WorkerRecord("w2", "p", registered_at=100.0, devices=1)
    events = [ev(100, EventType.REGISTERED, "w2"), ev(130, EventType.RESTORE, "w2", restore_s=5.0, status="ok")]
    assert phases(worker_segments(w, events, Window(0, 200))) == [(100, 130, "recovering"), (130, 200, "useful")]


def test_a_launcher_recovery_naming_the_worker_counts_back_total_s() -> None:
    w = WorkerRecord("w1", "p", registered_at=0.0, devices=1)
    rec = Event(ts=500, type=EventType.RECOVERY, pool="p", data={"worker": "w1", "total_s": 100.0, "mode": "heal"})
    assert phases(worker_segments(w, [rec], Window(0, 600))) == [
        (0, 400, "useful"),
        (400, 500, "recovering"),
        (500, 600, "useful"),
    ]


def test_a_worker_without_progress_is_idle_and_recovering_wins() -> None:
    w = WorkerRecord("w1", "p", registered_at=0.0, devices=1, progressed=False)
    events = [level(100, 1), ev(200, EventType.LOST), ev(300, EventType.REJOINED)]
    assert phases(worker_segments(w, events, Window(0, 400))) == [
        (0, 200, "idle"),
        (200, 300, "recovering"),
        (300, 400, "idle"),
    ]


def test_account_adds_up_prices_and_splits_per_group() -> None:
    # Hand computation over [0, 3600):
    #   a (group g1, 2 devices): useful 0-1800, degraded 1800-3600  -> useful 1.0 h, degraded 1.0 h
    #   b (group g2, no device -> 1 assumed): registered at 1800, idle  -> idle 0.5 h
    #   c (pool q, 1 device): lost at 2700, never back              -> useful 0.75 h, recovering 0.25 h
    workers = [
        WorkerRecord("a", "p", "g1", 0.0, device="d0", devices=2, step_ms=500.0),
        WorkerRecord("b", "p", "g2", 1800.0, devices=None, progressed=False),
        WorkerRecord("c", "q", "g1", 0.0, device="d9", devices=1),
    ]
    events = [level(1800, 1, "a"), ev(2700, EventType.LOST, "c", "q")]
    r = account(workers, events, Window(0, H), price_per_device_hour=2.5)
    d = r.to_dict()
    p = next(x for x in d["pools"] if x["pool"] == "p")
    q = next(x for x in d["pools"] if x["pool"] == "q")
    assert p["device_hours"] == {"total": 2.5, "useful": 1.0, "degraded": 1.0, "recovering": 0.0, "idle": 0.5}
    assert q["device_hours"] == {"total": 1.0, "useful": 0.75, "degraded": 0.0, "recovering": 0.25, "idle": 0.0}
    assert d["device_hours"]["total"] == pytest.approx(3.5)
    assert d["cost"]["total"] == pytest.approx(8.75) and d["cost"]["degraded"] == pytest.approx(2.5)
    assert p["groups"]["g1"]["device_hours"]["degraded"] == 1.0 and p["groups"]["g2"]["device_hours"]["idle"] == 0.5
    # a ran 1800 s degraded at 500 ms a step: 3600 steps, an estimate
    assert p["opportunity"]["degraded_steps"] == pytest.approx(3600.0)
    assert any(s.startswith("devices: 1 worker") for s in d["estimated"])
    assert any(s.startswith("degraded_steps") for s in d["estimated"])
    assert d["implicit"]["probe_overhead_ms_per_step"] is None and d["notes"]


def test_price_zero_gives_hours_only() -> None:
    r = account([WorkerRecord("a", "p", devices=1)], [], Window(0, 1800))
    assert r.to_dict()["cost"]["total"] == 0.0 and r.hours.total == 0.5


def test_workers_outside_the_window_are_left_out() -> None:
    workers = [WorkerRecord("a", "p", registered_at=5000.0, devices=1), WorkerRecord("b", "p", ended_at=10.0)]
    assert account(workers, [], Window(100, 200)).pools == {}


def test_snapshot_overhead_sums_bytes_and_times() -> None:
    events = [
        ev(1, EventType.SNAPSHOT, bytes=1000, stage_ms=10.0, total_ms=200.0, blocking_ms=1.0, status="ok"),
        ev(2, EventType.SNAPSHOT, bytes=500, stage_ms=30.0, total_ms=100.0, blocking_ms=3.0),
        ev(3, EventType.SNAPSHOT, status="failed"),
    ]
    assert snapshot_overhead(events) == {
        "count": 2,
        "bytes": 1500.0,
        "stage_s": 0.04,
        "background_s": 0.3,
        "blocking_s": 0.004,
    }


def test_mean_ci_and_diff_by_hand() -> None:
    # xs = 1, 2, 3: mean 2, s = 1, half = 1.96 / sqrt(3) = 1.1316
    m = mean_ci([1.0, 2.0, 3.0])
    assert m.n == 3 and m.mean == 2.0 and m.ci95 == pytest.approx((2 - 1.13159, 2 + 1.13159), abs=1e-4)
    assert mean_ci([5.0]).to_dict() == {"n": 1, "mean": 5.0, "ci95": None}
    assert mean_ci([]).to_dict() == {"n": 0, "mean": None, "ci95": None}
    # a - b = 10 - 2 = 8; var 1 and 1, n 3 and 3: half = 1.96 * sqrt(2/3) = 1.6003
    d = diff_ci([9.0, 10.0, 11.0], [1.0, 2.0, 3.0])
    assert d.mean == 8.0 and d.ci95 == pytest.approx((8 - 1.60031, 8 + 1.60031), abs=1e-4)


def test_throughput_splits_snapshot_intervals_by_phase() -> None:
    # useful 0-1000 (10 steps/s), degraded 1000-2000 (5 steps/s); the pair spanning 900-1100 is in neither
    w = WorkerRecord("w1", "p", registered_at=0.0, device="d0", devices=1)
    steps = [(100, 1000), (500, 5000), (900, 9000), (1100, 10000), (1500, 12000), (1900, 14000)]
    snaps = [ev(t, EventType.SNAPSHOT, step=s) for t, s in steps]
    r = account([w], [level(1000, 1), *snaps], Window(0, 2000))
    (effect,) = r.to_dict()["pools"][0]["opportunity"]["throughput"]
    assert effect["useful"]["n"] == 2 and effect["useful"]["mean"] == 10.0
    assert effect["degraded"]["n"] == 2 and effect["degraded"]["mean"] == 5.0
    assert effect["degraded_minus_useful"]["mean"] == -5.0
    assert effect["degraded_minus_useful"]["ci95"] == [-5.0, -5.0]


def test_recovery_comparison_estimates_a_heal_as_a_restart() -> None:
    devices = {"r0": "d0", "r1": "d1"}
    events = [
        ev(10, EventType.RECOVERY, None, total_s=36.0, devices=devices),
        ev(20, EventType.RECOVERY, None, total_s=72.0, devices=devices),
        ev(30, EventType.RECOVERY, None, total_s=9.0, devices=devices, mode="heal"),
    ]
    out = recovery_comparison(events)
    # restarts: (36 + 72) s x 2 devices = 0.06 h; mean 54 s; heal 9 s x 2 = 0.005 h, as a restart 54 x 2 = 0.03 h
    assert out["restarts"] == 2 and out["restart_device_hours"] == pytest.approx(0.06)
    assert out["heal_device_hours"] == pytest.approx(0.005)
    assert out["heal_as_restart_device_hours_estimate"] == pytest.approx(0.03)
    assert out["saved_device_hours_estimate"] == pytest.approx(0.025)
    assert recovery_comparison(events[2:])["saved_device_hours_estimate"] is None


def test_process_usage_in_the_report() -> None:
    r = account([], [], Window(0, 10), process=ProcessUsage(cpu_s=3.0, rss_bytes=1 << 20, uptime_s=30.0))
    assert r.to_dict()["implicit"]["process"] == {
        "cpu_s": 3.0,
        "rss_bytes": 1 << 20,
        "uptime_s": 30.0,
        "cpu_share": 0.1,
    }
