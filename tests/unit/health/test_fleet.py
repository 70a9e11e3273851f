"""Fleet comparison: stragglers stand out from their peers, a whole-pool slowdown does not."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.health.fleet import (
    DEFAULT_FEATURES,
    FeatureSpec,
    FleetConfig,
    FleetReport,
    PeerSample,
    compare,
)
from dsec.model import Role

HEALTHY_LAG = [1.0, 1.4, 0.8, 1.2, 1.1, 0.9, 1.3]  # ms, a healthy pool's sync lags


def actors(feature: str, values: list[float], role: str = "actor", prefix: str = "a") -> list[PeerSample]:
    return [PeerSample(f"{prefix}{i}", role, "g0", {feature: v}) for i, v in enumerate(values)]


def flagged(report: FleetReport, feature: str | None = None) -> set[str]:
    return {o.worker_id for o in report.outliers if feature is None or o.feature == feature}


def test_one_straggler_among_eight_is_flagged_on_sync_lag() -> None:
    report = compare(actors("sync_lag_ms_p50", [*HEALTHY_LAG, 40.0]))
    assert flagged(report) == {"a7"}
    (o,) = report.outliers
    assert o.feature == "sync_lag_ms_p50" and o.role == "actor" and o.value == 40.0
    assert o.median == pytest.approx(1.15) and o.z > 3.5
    assert report.outliers_by_worker() == {"a7": [o]}
    (stats,) = report.stats
    assert (stats.role, stats.feature, stats.n) == ("actor", "sync_lag_ms_p50", 8)


def test_whole_pool_slow_flags_nobody_and_the_median_moves() -> None:
    base = [*HEALTHY_LAG, 1.05]
    before = compare(actors("sync_lag_ms_p50", base))
    after = compare(actors("sync_lag_ms_p50", [v + 60.0 for v in base]))
    assert flagged(before) == flagged(after) == set()
    assert after.stats[0].median == pytest.approx(before.stats[0].median + 60.0)
    assert after.stats[0].mad == pytest.approx(before.stats[0].mad)


def test_two_of_eight_slow_are_both_flagged() -> None:
    values = [1.0, 1.4, 0.8, 1.2, 1.1, 0.9, 35.0, 42.0]
    assert flagged(compare(actors("sync_lag_ms_p50", values))) == {"a6", "a7"}


def test_below_min_peers_nothing_is_compared_but_stats_are_reported() -> None:
    report = compare(actors("sync_lag_ms_p50", [1.0, 90.0]))
    assert report.outliers == ()
    assert report.stats[0].n == 2
    report = compare(actors("sync_lag_ms_p50", [1.0, 1.0, 1.0, 90.0]), FleetConfig(min_peers=5))
    assert report.outliers == ()


def test_identical_peers_and_a_difference_below_the_floor_is_not_flagged() -> None:
    # MAD = 0: a plain robust z would be infinite for the 3 ms difference.
    report = compare(actors("step_ms_mean", [100.0] * 7 + [103.0]))
    assert report.stats[0].mad == 0.0
    assert report.outliers == ()
    # Above the absolute floor (5 ms) but below the relative one (10% of 100 ms): still quiet.
    assert compare(actors("step_ms_mean", [100.0] * 7 + [108.0])).outliers == ()
    # Above both: flagged, with a finite z.
    (o,) = compare(actors("step_ms_mean", [100.0] * 7 + [111.0])).outliers
    assert o.worker_id == "a7" and math.isfinite(o.z) and o.z > 3.5


def test_nan_inf_missing_and_non_numeric_values_are_ignored() -> None:
    samples = actors("sync_lag_ms_p50", [*HEALTHY_LAG, 40.0])
    samples += [
        PeerSample("x0", "actor", "g0", {"sync_lag_ms_p50": math.nan}),
        PeerSample("x1", "actor", "g0", {"sync_lag_ms_p50": math.inf}),
        PeerSample("x2", "actor", "g0", {"sync_lag_ms_p50": -math.inf}),
        PeerSample("x3", "actor", "g0", {}),
        PeerSample("x4", "actor", "g0", {"sync_lag_ms_p50": "fast"}),  # type: ignore[dict-item]
    ]
    report = compare(samples)
    assert flagged(report) == {"a7"}
    assert report.stats[0].n == 8


def test_roles_are_compared_separately() -> None:
    # Learners step 10x slower than actors by design: neither group is an outlier of the other.
    samples = actors("step_ms_mean", [20.0, 21.0, 19.0, 20.5], role=Role.ACTOR, prefix="a")
    samples += actors("step_ms_mean", [200.0, 205.0, 198.0, 400.0], role="learner", prefix="l")
    report = compare(samples)
    assert flagged(report) == {"l3"}
    assert [(s.role, s.n) for s in report.stats] == [("actor", 4), ("learner", 4)]
    assert report.stats[0].median == pytest.approx(20.25)


def test_direction_both_flags_either_side_for_reward_variance_shift() -> None:
    values = [0.05, -0.1, 0.0, 0.1, -0.05, 0.02, 2.5, -2.5]
    report = compare(actors("reward_variance_shift", values))
    assert flagged(report) == {"a6", "a7"}
    signs = {o.worker_id: o.z > 0 for o in report.outliers}
    assert signs == {"a6": True, "a7": False}


def test_direction_high_ignores_fast_workers_and_low_flags_them() -> None:
    values = [100.0, 101.0, 99.0, 100.5, 99.5, 100.2, 10.0]
    assert compare(actors("step_ms_mean", values)).outliers == ()
    low = FleetConfig(features=(FeatureSpec("step_ms_mean", "low", 5.0, 0.1),))
    assert flagged(compare(actors("step_ms_mean", values), low)) == {"a6"}


def test_report_to_dict_and_order_are_stable() -> None:
    samples = actors("sync_lag_ms_p50", [*HEALTHY_LAG, 40.0])
    samples += actors("step_ms_mean", [20.0, 21.0, 19.0, 90.0], prefix="b")
    report = compare(samples)
    assert compare(reversed(samples)) == report
    d = report.to_dict()
    assert [s["feature"] for s in d["stats"]] == ["step_ms_mean", "sync_lag_ms_p50"]  # config order
    assert [o["worker_id"] for o in d["outliers"]] == ["b3", "a7"]
    assert set(d["outliers"][0]) == {"worker_id", "role", "feature", "value", "median", "mad", "z"}


def test_default_features_cover_the_probe_metrics() -> None:
    assert {f.name: f.direction for f in DEFAULT_FEATURES} == {
        "step_ms_mean": "high",
        "compute_ms_p50": "high",
        "sync_lag_ms_p50": "high",
        "sync_latency_ms_p50": "high",
        "episode_length_cv": "high",
        "reward_variance_shift": "both",
        "grad_norm_slope": "high",
    }


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: FeatureSpec("", "high", 0, 0), "name"),
        (lambda: FeatureSpec("x", "up", 0, 0), "direction"),  # type: ignore[arg-type]
        (lambda: FeatureSpec("x", "high", -1, 0), "min_abs_excess"),
        (lambda: FeatureSpec("x", "high", 0, math.nan), "min_rel_excess"),
        (lambda: FleetConfig(z_threshold=0), "z_threshold"),
        (lambda: FleetConfig(min_peers=2), "min_peers"),
        (lambda: FleetConfig(features=(DEFAULT_FEATURES[0], DEFAULT_FEATURES[0])), "features"),
        (lambda: PeerSample("", "actor", "g", {}), "worker_id"),
        (lambda: PeerSample("w", "", "g", {}), "role"),
        (lambda: compare([PeerSample("w", "actor", "g"), PeerSample("w", "actor", "g")]), "worker_id"),
    ],
)
def test_invalid_inputs_name_the_field(build: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        build()  # type: ignore[operator]


# -- properties -------------------------------------------------------------------------------------
FEATURE = "m"
DIRECTION = st.sampled_from(["high", "low", "both"])
# Integer-valued floats: sums, halves and differences are exact, so shifting every value by an integer
# cannot move a z across the threshold by rounding alone.
INT_VALUES = st.lists(st.integers(-1000, 1000).map(float), min_size=3, max_size=12)
# Values on a 0.01 grid: every non-zero difference is far above the 1e-9 scale guard.
GRID_VALUES = st.lists(st.integers(-100_000, 100_000).map(lambda i: i / 100), min_size=3, max_size=12)


def one_feature(direction: str, min_abs: float = 0.0, min_rel: float = 0.0) -> FleetConfig:
    return FleetConfig(features=(FeatureSpec(FEATURE, direction, min_abs, min_rel),))  # type: ignore[arg-type]


def outlier_ids(values: list[float], config: FleetConfig) -> set[str]:
    return flagged(compare(actors(FEATURE, values), config))


@settings(max_examples=300, deadline=None)
@given(values=INT_VALUES, shift=st.integers(-10_000, 10_000), direction=DIRECTION, min_abs=st.integers(0, 50))
def test_shifting_every_value_never_changes_the_outliers(
    values: list[float], shift: int, direction: str, min_abs: int
) -> None:
    config = one_feature(direction, min_abs=float(min_abs), min_rel=0.0)
    assert outlier_ids([v + shift for v in values], config) == outlier_ids(values, config)


@settings(max_examples=300, deadline=None)
@given(values=GRID_VALUES, exponent=st.integers(-10, 10), direction=DIRECTION)
def test_scaling_every_value_never_changes_the_outliers_with_zero_floors(
    values: list[float], exponent: int, direction: str
) -> None:
    # Powers of two scale floats exactly, so medians, MADs and z are scaled without any rounding.
    config = one_feature(direction)
    factor = 2.0**exponent
    assert outlier_ids([v * factor for v in values], config) == outlier_ids(values, config)


@settings(max_examples=300, deadline=None)
@given(
    values=st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=3, max_size=12),
    direction=DIRECTION,
    min_abs=st.floats(0, 100),
    min_rel=st.floats(0, 2),
)
def test_a_flagged_worker_is_beyond_the_median_in_the_flagged_direction(
    values: list[float], direction: str, min_abs: float, min_rel: float
) -> None:
    report = compare(actors(FEATURE, values), one_feature(direction, min_abs, min_rel))
    for o in report.outliers:
        assert abs(o.value - o.median) > min_abs
        if direction == "high":
            assert o.value > o.median and o.z > 0
        elif direction == "low":
            assert o.value < o.median and o.z < 0
        else:
            assert o.value != o.median and (o.z > 0) == (o.value > o.median)
