"""Quotas as grants with limits (issue 17): a burst runs into memory its neighbours do not hold instead of failing
at its grant; a grant is always within the limit; growth leads a ramp; idle grants come back."""

from __future__ import annotations

import pytest

from dsec.quota import MemoryTrend, QuotaConfig, WorkerMemory, plan
from dsec.quota.elastic import _grid_ceil

BASE, CEILING, CARD = 16.0, 26.0, 80.0


def test_a_limit_is_all_the_memory_the_neighbours_do_not_hold() -> None:
    ws = [WorkerMemory(w, used, grant, bursting=True) for w, used, grant in (("a", 10.0, 16.0), ("b", 12.0, 16.0),
                                                                            ("c", 14.0, 20.0))]  # fmt: skip
    result = plan(CARD, BASE, CEILING, ws)
    assert result.limit_changes == {"a": 54.0, "b": 56.0, "c": 58.0}


def test_a_limit_is_never_below_the_grant() -> None:
    # the neighbours burst past their grants: this worker still may use its own grant
    ws = [WorkerMemory("a", 10.0, 24.0), WorkerMemory("b", 40.0, 26.0), WorkerMemory("c", 30.0, 26.0)]
    assert plan(CARD, BASE, CEILING, ws).limit_changes["a"] == 24.0


def test_a_silent_neighbour_counts_with_its_whole_grant_and_gets_no_limit() -> None:
    ws = [WorkerMemory("a", 10.0, 16.0, bursting=True), WorkerMemory("b", None, 26.0)]
    assert plan(CARD, BASE, CEILING, ws).limit_changes == {"a": CARD - 26.0}


def test_only_a_burst_runs_past_the_ceiling_a_slow_leak_stops_there() -> None:
    leak = WorkerMemory("a", 25.0, CEILING)
    burst = WorkerMemory("a", 25.0, CEILING, bursting=True)
    assert plan(CARD, BASE, CEILING, [leak]).limit_changes == {"a": CEILING}
    assert plan(CARD, BASE, CEILING, [burst]).limit_changes == {"a": CARD}


def test_a_trend_is_a_burst_only_for_a_steep_ramp_and_for_a_while() -> None:
    leak = MemoryTrend.first(10.0, 0.0)
    for i in range(1, 30):
        leak = leak.observe(10.0 + 0.001 * 60 * i, 60.0 * i)  # 3.6 GB/h
    assert not leak.bursting(leak.t)
    burst = MemoryTrend.first(10.0, 0.0).observe(11.0, 2.0).observe(12.0, 4.0)  # 0.5 GB/s
    assert burst.bursting(4.0) and burst.bursting(250.0) and not burst.bursting(400.0)


def test_a_workers_ceiling_binds_a_burst_only_below_the_pools() -> None:
    # Every worker registers with the pool's ceiling in its fields: that is no ceiling of its own.
    registered = WorkerMemory("a", 25.0, CEILING, ceiling_gb=CEILING, bursting=True)
    lowered = WorkerMemory("a", 25.0, CEILING - 2, ceiling_gb=CEILING - 2, bursting=True)
    assert plan(CARD, BASE, CEILING, [registered]).limit_changes == {"a": CARD}
    assert plan(CARD, BASE, CEILING, [lowered]).limit_changes == {"a": CEILING - 2}


def test_a_process_filling_its_working_set_from_nothing_is_starting_not_bursting() -> None:
    # A worker registers before its first allocation (0 GB), then holds its model and cache (10 GB) a beat later.
    start = MemoryTrend.first(0.0, 0.0).observe(10.0, 1.0)
    assert start.ramp_gb_per_s == 0.0 and not start.bursting(1.0) and start.peak_gb == 10.0
    burst = start.observe(11.0, 3.0).observe(12.0, 5.0)  # then 0.5 GB/s: a burst
    assert burst.bursting(5.0)


def test_a_limit_never_exceeds_the_device_nor_a_lowered_worker_ceiling() -> None:
    ws = [WorkerMemory("a", 1.0, 16.0, bursting=True), WorkerMemory("b", 1.0, 16.0, ceiling_gb=18.0, bursting=True)]
    result = plan(2 * CARD, BASE, CEILING, ws, device_gb=CARD)
    assert result.limit_changes == {"a": CARD, "b": 18.0}


def test_unknown_capacity_issues_no_limit() -> None:
    assert plan(None, BASE, CEILING, [WorkerMemory("a", 10.0, 16.0)]).limit_changes == {}


def test_limits_are_reissued_when_they_move_a_full_step() -> None:
    ws = [
        WorkerMemory("a", 10.0, 16.0, limit_gb=70.0, bursting=True),
        WorkerMemory("b", 10.0, 16.0, limit_gb=70.0, bursting=True),
    ]
    assert plan(CARD, BASE, CEILING, ws).limit_changes == {}  # 80 - 10: unchanged
    # b grew by half a GB: a's limit would fall by half a step — not worth a directive
    wobble = [ws[0], WorkerMemory("b", 10.5, 16.0, limit_gb=70.0, bursting=True)]
    assert plan(CARD, BASE, CEILING, wobble).limit_changes == {}
    # by a full step: re-issued, falling or rising
    grown = [ws[0], WorkerMemory("b", 11.0, 16.0, limit_gb=70.0, bursting=True)]
    assert plan(CARD, BASE, CEILING, grown).limit_changes == {"a": 69.0}
    back = [
        WorkerMemory("a", 10.0, 16.0, limit_gb=69.0, bursting=True),
        WorkerMemory("b", 10.0, 16.0, limit_gb=70.0, bursting=True),
    ]
    assert plan(CARD, BASE, CEILING, back).limit_changes == {"a": 70.0}


def test_a_limit_below_a_grown_grant_is_reissued() -> None:
    ws = [WorkerMemory("a", 60.0, 16.0, limit_gb=16.5), WorkerMemory("b", 15.0, 16.0, limit_gb=20.0)]
    result = plan(CARD, BASE, CEILING, ws)
    assert result.changes["b"] == 17.0 and "b" not in result.limit_changes  # 80 - 60 = 20 still, >= the new grant
    crowded = [WorkerMemory("a", 66.0, 16.0, limit_gb=16.5), WorkerMemory("b", 15.0, 16.0, limit_gb=16.2)]
    result = plan(CARD, BASE, CEILING, crowded)
    assert result.changes["b"] == 17.0 and result.limit_changes["b"] == 17.0  # the grant holds


def test_growth_leads_an_observed_ramp_instead_of_trailing_it() -> None:
    # 14.5 GB used of 16, ramping 0.5 GB/s: in 4 s it needs 16.5, plus 10% slack -> 18.15 -> 19 on the grid
    ramping = plan(CARD, BASE, CEILING, [WorkerMemory("a", 14.5, 16.0, ramp_gb_per_s=0.5)])
    assert ramping.changes == {"a": 19.0}
    flat = plan(CARD, BASE, CEILING, [WorkerMemory("a", 14.5, 16.0)])
    assert flat.changes == {"a": 17.0}  # one step, as before
    # a ramp alone (usage still under the threshold) makes a worker grow early
    early = plan(CARD, BASE, CEILING, [WorkerMemory("a", 12.0, 16.0, ramp_gb_per_s=0.5)])
    assert early.changes == {"a": 17.0}
    assert plan(CARD, BASE, CEILING, [WorkerMemory("a", 12.0, 16.0)]).changes == {}


def test_growth_stops_at_the_ceiling_even_for_a_steep_ramp() -> None:
    assert plan(CARD, BASE, CEILING, [WorkerMemory("a", 24.0, 25.0, ramp_gb_per_s=5.0)]).changes == {"a": CEILING}


def test_an_idle_grant_comes_back_and_stays_back() -> None:
    config = QuotaConfig()
    w = WorkerMemory("a", 14.0, 24.0, recent_peak_gb=14.0)
    result = plan(CARD, BASE, CEILING, [w], config)
    target = _grid_ceil(14.0 * 1.1 / 0.85, BASE, CEILING, 1.0)
    assert result.changes == {"a": target} and target < 24.0
    assert "idle grant" in result.reasons["a"]
    # the same usage again: neither growth nor another reclaim (a fixed point)
    assert plan(CARD, BASE, CEILING, result.apply([w]), config).changes == {}


def test_a_grant_in_use_is_not_reclaimed_as_idle() -> None:
    assert plan(CARD, BASE, CEILING, [WorkerMemory("a", 20.0, 24.0, recent_peak_gb=21.0)]).changes == {}


def test_without_a_tracked_peak_no_idle_reclaim() -> None:
    assert plan(CARD, BASE, CEILING, [WorkerMemory("a", 14.0, 24.0)]).changes == {}


@pytest.mark.parametrize("field", ["ramp_gb_per_s", "recent_peak_gb", "limit_gb"])
def test_bad_trend_fields_are_rejected_by_name(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        WorkerMemory("a", 1.0, 16.0, **{field: -1.0})  # type: ignore[arg-type]


def test_a_trend_follows_a_ramp_and_forgets_an_old_peak() -> None:
    t = MemoryTrend.first(10.0, 0.0)
    t = t.observe(12.0, 2.0)  # 1 GB/s, smoothed by half
    assert t.ramp_gb_per_s == pytest.approx(0.5) and t.peak_gb == 12.0
    t = t.observe(14.0, 4.0)
    assert t.ramp_gb_per_s == pytest.approx(0.75)
    t = t.observe(11.0, 6.0)  # shrinking: no negative ramp; the peak holds
    assert t.ramp_gb_per_s == pytest.approx(0.375) and t.peak_gb == 14.0
    t = t.observe(11.0, 6.1)  # too close to the last reading for a rate
    assert t.ramp_gb_per_s == pytest.approx(0.375) and t.t == 6.0
    t = t.observe(11.0, 70.0)  # a minute later the peak is history
    assert t.peak_gb == 11.0
