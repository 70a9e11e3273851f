"""dsec.decide.cadence: the snapshot interval from the failure history (Young's sqrt(2 C M), bounded)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dsec.decide.cadence import CadenceConfig, snapshot_interval_s, young_interval_s


def test_young_interval_is_the_classic_formula() -> None:
    assert young_interval_s(0.5, 3600.0) == pytest.approx(60.0)
    assert young_interval_s(0.25, 20_000.0) == pytest.approx(100.0)
    assert young_interval_s(0.0, 3600.0) == 0.0


def test_no_history_gets_the_configured_interval_quiet_time_lengthens_it_rollbacks_shorten_it() -> None:
    assert snapshot_interval_s(0.25, 0.0, 0, 90.0) == pytest.approx(90.0)
    m0 = 90.0**2 / (2 * 0.25)  # 16,200 s: the MTBF for which 90 s is Young's interval
    day = 8 * 86_400.0  # 8 groups for a day
    assert snapshot_interval_s(0.25, day, 0, 90.0) == pytest.approx(math.sqrt(2 * 0.25 * (day + m0)))  # ~594 s
    assert snapshot_interval_s(0.25, day, 3, 90.0) == pytest.approx(math.sqrt(2 * 0.25 * (day + m0) / 4))  # ~297 s
    # Failing more often than the prior assumed: shorter than configured.
    assert snapshot_interval_s(0.25, 3600.0, 10, 90.0) < 90.0


def test_the_job_s_other_groups_are_the_prior_a_group_s_own_failures_still_pull_it_down() -> None:
    m0 = 90.0**2 / (2 * 0.25)
    hour, week = 3600.0, 7 * 86_400.0
    # No peers, or peers without history: the single-group rule, exactly.
    assert snapshot_interval_s(0.25, hour, 1, 90.0, peers=(0.0, 0)) == snapshot_interval_s(0.25, hour, 1, 90.0)
    # 7 calm peers for an hour: the prior MTBF is their exposure plus M0, as if the group had trained 8 hours.
    calm = snapshot_interval_s(0.25, hour, 0, 90.0, peers=(7 * hour, 0))
    assert calm == pytest.approx(math.sqrt(2 * 0.25 * (hour + 7 * hour + m0)))
    assert calm > snapshot_interval_s(0.25, hour, 0, 90.0)
    # Peers that fail: their rate divides the prior (7 rollbacks in 7 hours: ~1 h between failures).
    assert snapshot_interval_s(0.25, hour, 0, 90.0, peers=(7 * hour, 7)) == pytest.approx(
        math.sqrt(2 * 0.25 * (hour + (7 * hour + m0) / 8))
    )
    # A group whose own learner keeps failing shortens its interval even in a job that has been calm for a week.
    assert snapshot_interval_s(0.25, hour, 6, 90.0, peers=(week, 0)) < 0.5 * snapshot_interval_s(
        0.25, hour, 0, 90.0, peers=(week, 0)
    )


def test_bounds_hold_at_both_ends_and_free_snapshots_go_to_the_floor() -> None:
    cfg = CadenceConfig(floor_s=30.0, ceiling_s=1800.0)
    assert snapshot_interval_s(0.25, 100.0, 50, 90.0, cfg) == 30.0
    assert snapshot_interval_s(5.0, 1e9, 0, 90.0, cfg) == 1800.0
    assert snapshot_interval_s(0.0, 1e6, 0, 90.0, cfg) == 30.0


@given(
    cost=st.floats(1e-3, 10.0),
    exposure=st.floats(0.0, 1e8),
    rollbacks=st.integers(0, 1000),
    more=st.integers(1, 100),
    longer=st.floats(0.0, 1e6),
)
def test_rollbacks_never_lengthen_and_quiet_time_never_shortens_the_interval(
    cost: float, exposure: float, rollbacks: int, more: int, longer: float
) -> None:
    a = snapshot_interval_s(cost, exposure, rollbacks, 90.0)
    assert 30.0 <= snapshot_interval_s(cost, exposure, rollbacks + more, 90.0) <= a <= 1800.0  # 90 s: within
    assert snapshot_interval_s(cost, exposure + longer, rollbacks, 90.0) >= a


def test_a_configured_interval_outside_the_bounds_widens_them() -> None:
    cfg = CadenceConfig(floor_s=30.0, ceiling_s=1800.0)
    assert snapshot_interval_s(0.05, 0.0, 0, 1.0, cfg) == pytest.approx(1.0)  # asked for 1 s: 1 s at first
    assert 1.0 <= snapshot_interval_s(0.05, 20.0, 5, 1.0, cfg) < 30.0  # failing often: not forced up to 30 s
    assert snapshot_interval_s(0.25, 0.0, 0, 3600.0, cfg) == pytest.approx(3600.0)  # nor down to 30 min
