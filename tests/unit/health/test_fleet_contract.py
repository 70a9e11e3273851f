"""Fleet comparison: what a report carries, its order, the median of odd and even counts, the min_peers edge, the
floored scale, and the configuration's checks (written against the survivors of `make mutation`, docs/testing.md)."""

from __future__ import annotations

import pytest

from dsec.health.fleet import FeatureSpec, FleetConfig, PeerSample, compare
from dsec.model import Role

X = FeatureSpec("x", "high", min_abs_excess=1.0, min_rel_excess=0.0)
Y = FeatureSpec("y", "high", min_abs_excess=1.0, min_rel_excess=0.0)


def peers(metric: str, values: list[float], prefix: str = "w") -> list[PeerSample]:
    return [PeerSample(f"{prefix}{i}", "actor", "g", {metric: v}) for i, v in enumerate(values)]


def test_report_dicts_carry_every_field_and_the_outlier_its_roles_mad() -> None:
    report = compare(peers("x", [1.0, 1.0, 1.0, 1.0, 5.0]), FleetConfig(features=(X,)))
    [stats], [o] = report.stats, report.outliers
    assert stats.to_dict() == {"role": "actor", "feature": "x", "n": 5, "median": 1.0, "mad": 0.0}
    # Identical peers (MAD 0): the scale is floored at min_abs_excess / z_threshold, so z stays readable.
    assert o.to_dict() == {"worker_id": "w4", "role": "actor", "feature": "x", "value": 5.0, "median": 1.0,
                           "mad": 0.0, "z": pytest.approx(4.0 / (1.0 / 3.5))}  # fmt: skip


def test_the_median_of_an_odd_count_is_the_middle_value() -> None:
    assert compare(peers("x", [1.0, 2.0, 7.0]), FleetConfig(features=(X,))).stats[0].median == 2.0
    assert compare(peers("x", [1.0, 2.0, 3.0, 7.0]), FleetConfig(features=(X,))).stats[0].median == 2.5


def test_a_wide_spread_is_the_scale_not_the_floor() -> None:
    # MAD 1.4826 * 20: 95 is 1.9 MADs above the median of 40, no outlier (the floor alone would make it one).
    assert (
        compare(peers("x", [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 95.0]), FleetConfig(features=(X,))).outliers == ()
    )


def test_exactly_min_peers_reporting_are_compared_and_every_feature_is() -> None:
    # Feature x has too few reporters for a comparison; y, after it, has exactly min_peers and one outlier.
    samples = [PeerSample("a", "actor", "g", {"x": 1.0, "y": 1.0}), PeerSample("b", "actor", "g", {"y": 1.0}),
               PeerSample("c", "actor", "g", {"y": 9.0})]  # fmt: skip
    report = compare(samples, FleetConfig(min_peers=3, features=(X, Y)))
    assert [(o.worker_id, o.feature) for o in report.outliers] == [("c", "y")]


def test_outliers_by_worker_are_in_worker_id_order() -> None:
    # Report order is by feature first: x flags w9, then y flags w1. Grouped per worker: w1 first.
    samples = [PeerSample(f"w{i}", "actor", "g", {"x": 9.0 if i == 9 else 1.0, "y": 9.0 if i == 1 else 1.0})
               for i in range(1, 10)]  # fmt: skip
    report = compare(samples, FleetConfig(features=(X, Y)))
    assert [o.worker_id for o in report.outliers] == ["w9", "w1"]
    assert list(report.outliers_by_worker()) == ["w1", "w9"]


def test_config_checks() -> None:
    assert FleetConfig(z_threshold=0.5).z_threshold == 0.5
    for bad in (True, "3", 0.0):
        with pytest.raises(ValueError, match="z_threshold"):
            FleetConfig(z_threshold=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"min_peers=3\.5 is invalid"):
        FleetConfig(min_peers=3.5)  # type: ignore[arg-type]
    assert FleetConfig(features=[X]).features == (X,)  # type: ignore[arg-type]
    for field in ("min_abs_excess", "min_rel_excess"):
        with pytest.raises(ValueError, match=f"^{field}=-1 is invalid"):
            FeatureSpec("x", "high", **{"min_abs_excess": 0.0, "min_rel_excess": 0.0, field: -1})
    role = PeerSample("w", Role.ACTOR, "g").role  # type: ignore[arg-type]
    assert type(role) is str and role == "actor"  # the enum's value: hashed as the plain name


def test_direction_low_flags_only_far_below_a_wide_spread() -> None:
    low = FeatureSpec("x", "low", min_abs_excess=1.0, min_rel_excess=0.0)
    # 10 is 30 below the median of 40 but only ~1 MAD: not an outlier, in either direction.
    values = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0]
    assert compare(peers("x", values), FleetConfig(features=(low,))).outliers == ()


def test_direction_both_measures_the_distance_for_negative_values_too() -> None:
    both = FeatureSpec("x", "both", min_abs_excess=5.0, min_rel_excess=0.0)
    # Median 1, value -5: 6 away (beyond the floor of 5), though |value + median| would be only 4.
    [o] = compare(peers("x", [1.0, 1.0, 1.0, 1.0, -5.0]), FleetConfig(features=(both,))).outliers
    assert (o.worker_id, o.z) == ("w4", pytest.approx(-6.0 / (5.0 / 3.5)))


@pytest.mark.parametrize(("direction", "odd"), [("high", 40.0), ("low", -40.0), ("both", 40.0), ("both", -40.0)])
def test_a_worker_exactly_at_the_threshold_is_not_an_outlier(direction: str, odd: float) -> None:
    # Spread peers (the MAD is the scale, far above the tiny floors): find the odd worker's exact z, then make that
    # the threshold. Beyond means strictly beyond.
    spec = FeatureSpec("x", direction, min_abs_excess=1e-6, min_rel_excess=0.0)  # type: ignore[arg-type]
    samples = peers("x", [-3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, odd])
    [stats] = compare(samples, FleetConfig(features=(spec,))).stats
    z = (odd - stats.median) / stats.mad
    assert compare(samples, FleetConfig(z_threshold=abs(z), features=(spec,))).outliers == ()
    just_below = FleetConfig(z_threshold=abs(z) * (1 - 1e-9), features=(spec,))
    assert [o.worker_id for o in compare(samples, just_below).outliers] == ["w7"]
