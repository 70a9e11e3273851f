"""The cost gauges' ledger (dsec.cost.ledger, driven by dsec.control.cost.CostMeter): each refresh reads only what was
committed since the last one, and answers what a full replay of the same SQLite store answers."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dsec.control.cost import CostMeter
from dsec.control.retention import KEPT_TYPES
from dsec.control.settings import Settings
from dsec.control.state import HotState
from dsec.control.store import WriteBatch, open_store
from dsec.cost import Window, WorkerRecord
from dsec.cost.ledger import CostLedger
from dsec.model import Event, EventType

H = 3600.0
STATE = [
    EventType.REGISTERED,
    EventType.DEREGISTERED,
    EventType.LOST,
    EventType.REJOINED,
    EventType.MELTDOWN,
    EventType.BREAKER,
    EventType.RECOVERED,
    EventType.RESTORE,
]


def comparable(report: Any) -> dict[str, Any]:
    """A report's figures, less the control plane's own CPU and RSS (measured at each call)."""
    d = report.to_dict()
    d["implicit"]["process"] = None
    return d


def meter(tmp_path: Path) -> CostMeter:
    store = open_store(f"sqlite:///{tmp_path / 'state.db'}")
    cfg = Settings(home=tmp_path, database_url="sqlite://", cost_device_hour=2.0)
    return CostMeter(HotState(), store, cfg, clock=lambda: 0.0, started_at=0.0)


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[WorkerRecord], list[tuple[float | None, float | None]], list[Event]]:
    """Workers (with when each is live: from registration until retention removes it) and an event stream in commit
    order, timestamps out of order among them (late reports, a worker's clock)."""
    n = draw(st.integers(1, 6))
    workers, lives = [], []
    for i in range(n):
        reg = draw(st.floats(0, 12_000).map(round))
        ended = draw(st.none() | st.floats(reg, reg + 9_000).map(round))
        retired = draw(st.none() | st.floats(reg + 1, reg + 12_000).map(round))
        workers.append(
            WorkerRecord(
                f"w{i}",
                draw(st.sampled_from(["p", "q"])),
                draw(st.sampled_from(["g1", "g2"])),
                reg,
                ended,
                draw(st.sampled_from([None, "d0", "d1"])),
                1,
                draw(st.sampled_from([True, False])),
                50.0,
            )
        )
        lives.append((reg, retired))
    events = []
    for w in workers:
        events.append(
            Event(ts=w.registered_at, type=EventType.REGISTERED, worker_id=w.id, pool=w.pool, data={"group": w.group})
        )
    for _ in range(draw(st.integers(0, 25))):
        w = draw(st.sampled_from(workers))
        ts = round(draw(st.floats(0, 20_000)))
        kind = draw(st.sampled_from([*STATE[1:], EventType.RECOVERY, EventType.SNAPSHOT, EventType.LOG]))
        if kind is EventType.RECOVERY:
            total = draw(st.floats(0, 600).map(round))
            data: dict[str, Any] = {
                "worker": w.id,
                "total_s": total,
                "mode": draw(st.sampled_from(["heal", "restart"])),
            }
            events.append(Event(ts=ts, type=kind, worker_id=None, pool=w.pool, data=data))
            continue
        if kind is EventType.SNAPSHOT:
            data = {
                "step": draw(st.integers(0, 10_000)),
                "bytes": draw(st.sampled_from([1000, 0.1, 3e9])),
                "stage_ms": 3.0,
            }
            if draw(st.integers(0, 5)) == 0:
                data["status"] = "failed"  # a pool with only failed snapshots in the window still has its row
        elif kind in (EventType.MELTDOWN, EventType.BREAKER, EventType.RECOVERED):
            data = {"level_to": draw(st.integers(0, 3))}
        elif kind is EventType.RESTORE:
            data = {"status": draw(st.sampled_from(["ok", "failed"]))}
        else:
            data = {}
        events.append(Event(ts=ts, type=kind, worker_id=w.id, pool=w.pool, data=data))
    order = draw(st.permutations(range(len(events))))
    return workers, lives, [events[i] for i in order]


def refreshes(
    m: CostMeter,
    history: Any,
    passes: list[float],
    throughput: Callable[[int], bool],
    before: Callable[[int, float], None],
) -> Iterator[tuple[int, dict[str, Any], dict[str, Any]]]:
    """At each pass (in time order): commit a share of the stream (the rest later, in stream order), call
    ``before(k, now)``, then (k, the gauges' refresh, a full replay) of the live workers over the last hour."""
    workers, lives, events = history
    committed = 0
    for k, now in enumerate(sorted(passes)):
        upto = len(events) * (k + 1) // len(passes)
        if upto > committed:
            m.store.write(WriteBatch(events=events[committed:upto]))
            committed = upto
        before(k, now)
        live = [w for w, (reg, gone) in zip(workers, lives, strict=True) if reg < now and (gone is None or gone > now)]
        window = Window(max(0.0, now - H), now)
        gauges = comparable(m._gauge_report(live, window, now, throughput=throughput(k)))
        yield k, gauges, comparable(m._account(live, window, None, now))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    history=histories(),
    passes=st.lists(st.floats(100, 24_000).map(round), min_size=1, max_size=6, unique=True),
    throughputs=st.lists(st.booleans(), min_size=6, max_size=6),
)
def test_each_refresh_answers_what_a_full_replay_answers(
    tmp_path_factory: pytest.TempPathFactory, history: Any, passes: list[float], throughputs: list[bool]
) -> None:
    """The same figures, with or without the throughput effects (the gauges' refresh computes none)."""
    m = meter(tmp_path_factory.mktemp("ledger"))
    for k, gauges, full in refreshes(m, history, passes, lambda k: throughputs[k], lambda k, now: None):
        if not throughputs[k]:
            assert gauges["notes"][-1].startswith("throughput: not computed")
            gauges["notes"].pop()
            for pool in full["pools"]:
                pool["opportunity"]["throughput"] = []
        assert gauges == full, json.dumps([gauges["pools"], full["pools"]], default=str)
    m.store.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    history=histories(),
    passes=st.lists(st.floats(100, 24_000).map(round), min_size=2, max_size=6, unique=True),
    prune_after=st.integers(0, 4),
    age=st.floats(0, 6 * H).map(round),
)
def test_after_the_retention_pruned_the_store_each_refresh_still_answers_what_a_full_replay_answers(
    tmp_path_factory: pytest.TempPathFactory, history: Any, passes: list[float], prune_after: int, age: float
) -> None:
    """The retention pass deletes every event older than its cutoff but the kept types (control/retention.py) and
    tells the meter (``forget_pruned``): the ledger drops the same, so it does not go on counting what a full read
    of the store no longer sees (a live worker older than the retention: its registration and lost/rejoined)."""
    m = meter(tmp_path_factory.mktemp("pruned"))

    def prune(k: int, now: float) -> None:
        if k == min(prune_after, len(passes) - 1) and m.store.prune_events(now - age, KEPT_TYPES):
            m.forget_pruned(now - age, KEPT_TYPES)

    for _, gauges, full in refreshes(m, history, passes, lambda k: True, prune):
        assert gauges == full, json.dumps([gauges["pools"], full["pools"]], default=str)
    m.store.close()


def test_a_refresh_reads_only_what_was_committed_since(tmp_path: Path) -> None:
    m = meter(tmp_path)
    w = WorkerRecord("w1", "p", "g", 100.0, device="d0", devices=1)
    m.store.write(WriteBatch(events=[Event(ts=100.0, type=EventType.REGISTERED, worker_id="w1", pool="p", data={})]))
    first = m._gauge_report([w], Window(0.0, 1000.0), 1000.0)
    ledger = m._ledger
    assert ledger is not None and ledger.after_id == 1
    assert first.pools["p"].hours.useful == pytest.approx(900 / H)
    m.store.write(
        WriteBatch(events=[Event(ts=1500.0, type=EventType.MELTDOWN, worker_id="w1", pool="p", data={"level_to": 1})])
    )
    second = m._gauge_report([w], Window(0.0, 2000.0), 2000.0)
    assert m._ledger is ledger and ledger.after_id == 2  # the same ledger, fed the one new event
    assert second.pools["p"].hours.useful == pytest.approx(1400 / H)
    assert second.pools["p"].hours.degraded == pytest.approx(500 / H)


def test_a_window_reaching_back_past_the_ledger_reads_the_store_again(tmp_path: Path) -> None:
    m = meter(tmp_path)
    a = WorkerRecord("a", "p", "g", 5000.0, devices=1)
    m.store.write(WriteBatch(events=[Event(ts=5000.0, type=EventType.REGISTERED, worker_id="a", pool="p", data={})]))
    m._gauge_report([a], Window(4000.0, 7600.0), 7600.0)
    first = m._ledger
    assert first is not None and not first.covers(100.0, 4000.0)
    # A live worker registered long before (a control plane's hot state loaded at start, say) widens the replay.
    old = WorkerRecord("old", "p", "g", 100.0, devices=1)
    m.store.write(WriteBatch(events=[Event(ts=100.0, type=EventType.REGISTERED, worker_id="old", pool="p", data={})]))
    report = m._gauge_report([a, old], Window(4100.0, 7700.0), 7700.0)
    assert m._ledger is not first
    assert report.pools["p"].workers == 2
    with pytest.raises(ValueError, match="read the store again"):
        first.report([a, old], Window(4100.0, 7700.0), 7700.0)


def test_a_recovery_before_the_window_ends_a_failure_that_began_before_it(tmp_path: Path) -> None:
    """Lost at 100, restored by its launcher at 300 (a ``recovery`` event naming it): the next hours are useful. The
    replay read ``recovery`` events within the window only, so such a worker stayed recovering in every later one."""
    m = meter(tmp_path)
    w = WorkerRecord("w1", "p", "g", 0.0, devices=1)
    m.store.write(
        WriteBatch(
            events=[
                Event(ts=0.0, type=EventType.REGISTERED, worker_id="w1", pool="p", data={}),
                Event(ts=100.0, type=EventType.LOST, worker_id="w1", pool="p", data={}),
                Event(
                    ts=300.0, type=EventType.RECOVERY, worker_id=None, pool="p", data={"worker": "w1", "total_s": 200.0}
                ),
            ]
        )
    )
    window = Window(2 * H, 3 * H)
    for report in (m._account([w], window, None, 3 * H), m._gauge_report([w], window, 3 * H)):
        assert report.pools["p"].hours.useful == pytest.approx(1.0)
        assert report.pools["p"].hours.recovering == 0.0
    m.store.close()


def test_the_ledger_forgets_what_no_later_window_reads() -> None:
    ledger = CostLedger(0.0, 0.0)
    reg = [
        Event(id=i + 1, ts=float(t), type=EventType.REGISTERED, worker_id=f"w{i}", pool="p", data={})
        for i, t in enumerate([10, 5000])
    ]
    snap = Event(id=3, ts=20.0, type=EventType.SNAPSHOT, worker_id="w0", pool="p", data={"step": 1})
    ledger.feed([*reg, snap])
    live = [WorkerRecord("w1", "p", "g", 5000.0, devices=1)]
    ledger.report(live, Window(4000.0, 7600.0), 7600.0)
    # w0 retired and registered before anything a later report reads: gone, with the snapshot before the window.
    assert (
        set(ledger._workers) == {"w1"}
        and not ledger._snapshots
        and ledger._columns["p"].ts == []
        and [e.worker_id for e in ledger._registered] == ["w1"]
    )
    assert ledger.covers(4000.0, 4000.0) and not ledger.covers(3999.0, 4000.0)
