"""The reconcile pass skips its liveness scan while no active worker can be overdue (``HotState.quiet_until``):
``liveness.scan`` finds the same workers as ``overdue`` and a bound no worker is overdue before, and every way a worker
becomes active lowers the bound, so a worker is still marked lost on the first pass after its deadline. Real control
planes over real SQLite files, on a virtual clock."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dsec.control.reconcile as reconcile_mod
from conftest import ADMIN_TOKEN, VirtualClock, make_settings
from dsec.control.liveness import Beat, overdue, scan
from dsec.control.schemas import HeartbeatRequest, RegisterRequest
from dsec.control.service import ControlPlane
from dsec.control.store import open_store
from dsec.model import Pool, WorkerState

NOW = 1_700_000_000.0
BEATS = st.lists(
    st.builds(
        Beat,
        worker_id=st.text(min_size=1, max_size=4),
        state=st.sampled_from(list(WorkerState)),
        last_beat_at=st.floats(NOW - 500, NOW + 50),
        interval_s=st.floats(0.05, 60),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(beats=BEATS, after=st.integers(1, 5), later=st.floats(0, 600))
def test_scan_finds_the_overdue_workers_and_nobody_is_overdue_before_its_bound(
    beats: list[Beat], after: int, later: float
) -> None:
    late, quiet_until = scan(beats, NOW, after)
    # The rule written out, not through scan (overdue is scan's first half).
    rule = [b.worker_id for b in beats if b.state is WorkerState.ACTIVE and NOW - b.last_beat_at > after * b.interval_s]
    assert late == rule == overdue(beats, NOW, after)
    # Until the bound (less the reconcile pass's margin) no worker is overdue, whatever the time in between.
    t = min(NOW + later, quiet_until - reconcile_mod.QUIET_MARGIN_S)
    assert overdue(beats, t, after) == []
    active = [b for b in beats if b.state is WorkerState.ACTIVE]
    if active:  # and the bound is tight: just past it, the worker that set it is overdue
        assert overdue(beats, quiet_until + reconcile_mod.QUIET_MARGIN_S, after)
    else:
        assert quiet_until == float("inf")


@pytest.fixture
def clock() -> VirtualClock:
    return VirtualClock(NOW)


@pytest.fixture
async def cp(tmp_path: Path, clock: VirtualClock) -> AsyncIterator[ControlPlane]:
    settings = make_settings(tmp_path)
    store = open_store(settings.database_url)
    plane = ControlPlane(settings, store, clock)
    try:
        await plane.put_pool(Pool("pool-a"))
        yield plane
    finally:
        plane.close()
        store.close()


@pytest.fixture
def scans(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The times the reconcile pass scanned at."""
    seen: list[float] = []

    def counted(beats: Any, now: float, after: int) -> tuple[list[str], float]:
        seen.append(now)
        return scan(beats, now, after)

    monkeypatch.setattr(reconcile_mod, "scan", counted)
    return seen


async def _register(cp: ControlPlane, interval_s: float) -> str:
    reg = await cp.register(RegisterRequest(pool="pool-a", heartbeat_interval_s=interval_s), ADMIN_TOKEN)
    return str(reg["worker_id"])


async def test_no_scan_while_nobody_can_be_overdue(cp: ControlPlane, clock: VirtualClock, scans: list[float]) -> None:
    slow = await _register(cp, 10.0)  # lost after 3 x 10 s of silence
    await cp.reconcile()
    assert len(scans) == 1 and cp.state.quiet_until == pytest.approx(NOW + 30.0)
    for _ in range(10):
        clock.now += 2.5
        assert await cp.reconcile() == []
    assert len(scans) == 1  # 25 s later: still before anybody's deadline
    clock.now += 5.1
    assert await cp.reconcile() == [slow]
    assert len(scans) == 2 and cp.state.workers[slow].state is WorkerState.LOST


async def test_a_worker_registered_after_a_scan_is_lost_on_time(
    cp: ControlPlane, clock: VirtualClock, scans: list[float]
) -> None:
    await _register(cp, 10.0)
    await cp.reconcile()  # the bound is 30 s away
    fast = await _register(cp, 0.1)  # ... and this one is overdue 0.3 s from now
    assert cp.state.quiet_until == pytest.approx(NOW + 0.3)
    clock.now += 0.25
    assert await cp.reconcile() == [] and len(scans) == 1
    clock.now += 0.1
    assert await cp.reconcile() == [fast]


async def test_a_worker_back_from_lost_is_lost_again_on_time(
    cp: ControlPlane, clock: VirtualClock, scans: list[float]
) -> None:
    await _register(cp, 10.0)
    fast = await _register(cp, 1.0)
    clock.now += 3.5
    assert await cp.reconcile() == [fast]
    clock.now += 0.1
    await cp.reconcile()  # the lost one no longer counts: the bound is the other's, 30 s after it registered
    assert cp.state.quiet_until == pytest.approx(NOW + 30.0)
    w = cp.state.workers[fast]
    await cp.heartbeat(w, HeartbeatRequest(seq=1))  # back: a rejoin
    assert w.state is WorkerState.ACTIVE and cp.state.quiet_until == pytest.approx(clock.now + 3.0)
    clock.now += 2.0
    assert await cp.reconcile() == []
    clock.now += 1.5
    assert await cp.reconcile() == [fast]


async def test_a_pass_judging_an_earlier_time_scans(cp: ControlPlane, clock: VirtualClock, scans: list[float]) -> None:
    await _register(cp, 10.0)
    await cp.reconcile()
    clock.now -= 5.0  # the clock stepped back (or a stall moved the judged time back): the bound is not trusted
    await cp.reconcile()
    assert len(scans) == 2
