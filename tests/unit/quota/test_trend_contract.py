"""A worker's memory trend (quota/trend.py) at its boundaries, written against the survivors of the quota mutation run
(docs/testing.md): a reading exactly MIN_DT_S later counts, a burst's hold ends exactly at BURST_HOLD_S, a peak equal
to the last one is seen again now, a peak held exactly hold_s is still recent, a ramp of exactly the burst rate is a
burst, and observe passes its hold on."""

from __future__ import annotations

import math

from dsec.quota.trend import (
    BURST_HOLD_S,
    BURST_RAMP_GB_PER_S,
    MIN_DT_S,
    PEAK_HOLD_S,
    RAMP_FLOOR_GB_PER_S,
    MemoryTrend,
    observe_arrays,
)


def test_the_first_reading_is_its_own_peak_now() -> None:
    assert MemoryTrend.first(3.0, 10.0) == MemoryTrend(10.0, 3.0, 0.0, 3.0, 10.0, -math.inf)


def test_a_reading_exactly_min_dt_later_makes_a_ramp() -> None:
    trend = MemoryTrend.first(1.0, 0.0).observe(2.0, MIN_DT_S)
    assert (trend.t, trend.used_gb, trend.ramp_gb_per_s) == (MIN_DT_S, 2.0, 0.5 * 1.0 / MIN_DT_S)


def test_a_burst_holds_for_exactly_burst_hold_s() -> None:
    trend = MemoryTrend(0.0, 1.0, burst_t=100.0)
    assert trend.bursting(100.0 + BURST_HOLD_S) and not trend.bursting(100.0 + BURST_HOLD_S + 1e-6)


def test_a_ramp_of_exactly_the_burst_rate_is_a_burst() -> None:
    # ramp = 0.5 * rate + 0.5 * old ramp: equal to the threshold with the old ramp at it and the same rate.
    trend = MemoryTrend(0.0, 1.0, ramp_gb_per_s=BURST_RAMP_GB_PER_S).observe(1.0 + BURST_RAMP_GB_PER_S * 10, 10.0)
    assert trend.ramp_gb_per_s == BURST_RAMP_GB_PER_S and trend.burst_t == 10.0


def test_usage_equal_to_the_peak_renews_it_and_a_peak_held_exactly_hold_s_is_recent() -> None:
    trend = MemoryTrend.first(5.0, 0.0).observe(5.0, 10.0)
    assert (trend.peak_gb, trend.peak_t) == (5.0, 10.0)  # seen again now
    held = trend.observe(1.0, 10.0 + PEAK_HOLD_S)
    assert (held.peak_gb, held.peak_t) == (5.0, 10.0)  # exactly hold_s: still the recent peak
    gone = trend.observe(1.0, 10.0 + PEAK_HOLD_S + 1.0)
    assert (gone.peak_gb, gone.peak_t) == (1.0, 11.0 + PEAK_HOLD_S)


def test_observe_passes_its_hold_and_keeps_the_burst_time() -> None:
    trend = MemoryTrend(0.0, 5.0, peak_gb=5.0, peak_t=0.0, burst_t=-7.0)
    short = trend.observe(1.0, 20.0, hold_s=10.0)
    assert (short.peak_gb, short.peak_t, short.burst_t) == (1.0, 20.0, -7.0)


def test_a_ramp_decays_to_exactly_zero_after_a_burst() -> None:
    # A burst's ramp, then flat usage: the smoothing halves the ramp at each reading; below the floor it is none, so
    # a plan's inputs stop changing (without the floor it never reaches 0).
    trend = MemoryTrend.first(7.0, 0.0).observe(9.0, 10.0)
    assert trend.ramp_gb_per_s == 0.1
    ramps = []
    for k in range(2, 40):
        trend = trend.observe(9.0, 10.0 * k)
        ramps.append(trend.ramp_gb_per_s)
    assert ramps[-1] == 0.0 and ramps.index(0.0) == 16  # ramps[i] = 0.1 / 2**(i + 1): 0.1 / 2**17 < 1e-6
    assert all(r >= RAMP_FLOOR_GB_PER_S for r in ramps[:16])


def test_a_slow_leak_keeps_its_ramp() -> None:
    # 1.5 GB/h (a leaking card in the simulator) is far above the floor: it stays a ramp.
    trend = MemoryTrend.first(7.0, 0.0)
    for k in range(1, 30):
        trend = trend.observe(7.0 + 1.5 * 10.0 * k / 3600.0, 10.0 * k)
    assert math.isclose(trend.ramp_gb_per_s, 1.5 / 3600.0, rel_tol=1e-6)


def test_a_ramp_at_exactly_the_floor_is_kept() -> None:
    # RAMP_WEIGHT is 0.5: a ramp at the floor averaged with a fresh rate at the floor is the floor itself, exactly;
    # only a ramp below it is taken for noise (written against a survivor: `<` -> `<=`)
    floor = RAMP_FLOOR_GB_PER_S
    # (From a held amount x to 2x: the difference is x exactly; from 0 GB it would be a start, no rate.)
    _, _, ramp, *_ = observe_arrays(0.0, floor, floor, 0.0, 0.0, 2 * floor, 1.0)
    assert float(ramp) == floor
    _, _, below, *_ = observe_arrays(0.0, floor / 2, floor / 2, 0.0, 0.0, floor, 1.0)
    assert float(below) == 0.0
