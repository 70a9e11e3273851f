"""The fleet comparison reads each feature as one column (``_finite_column``) and pre-selects the candidates beyond
the cut (``_beyond``) instead of asking every worker one at a time: the same report as the per-sample code it
replaced, kept here as the reference, on any mix of roles, missing, integer, boolean, non-finite and boundary
values."""

from __future__ import annotations

import math
from collections.abc import Iterable

from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.health.fleet import (
    MAD_TO_SIGMA,
    FeatureSpec,
    FleetConfig,
    FleetReport,
    Outlier,
    PeerSample,
    RoleStats,
    _is_outlier,
    _median,
    compare,
)


def reference(samples: Iterable[PeerSample], config: FleetConfig) -> FleetReport:
    """``compare`` as written until 2026-12-06: ``PeerSample.value`` per worker and feature, every worker tested."""
    by_role: dict[str, list[PeerSample]] = {}
    for sample in samples:
        by_role.setdefault(sample.role, []).append(sample)
    stats, outliers = [], []
    for role in sorted(by_role):
        for spec in config.features:
            values = [(s.worker_id, v) for s in by_role[role] if (v := s.value(spec.name)) is not None]
            if not values:
                continue
            median = _median([v for _, v in values])
            mad = MAD_TO_SIGMA * _median([abs(v - median) for _, v in values])
            stats.append(RoleStats(role=role, feature=spec.name, n=len(values), median=median, mad=mad))
            if len(values) < config.min_peers:
                continue
            floor = max(spec.min_abs_excess, spec.min_rel_excess * abs(median))
            scale = max(mad, floor / config.z_threshold, 1e-9)
            for worker_id, v in sorted(values):
                z = _is_outlier(spec, v, median, scale, config.z_threshold)
                if z is not None:
                    outliers.append(Outlier(worker_id, role, spec.name, v, median, mad, z))
    return FleetReport(stats=tuple(stats), outliers=tuple(outliers))


SPECS = (
    FeatureSpec("hi", "high", min_abs_excess=1.0, min_rel_excess=0.1),
    FeatureSpec("lo", "low", min_abs_excess=0.5, min_rel_excess=0.0),
    FeatureSpec("both", "both", min_abs_excess=0.0, min_rel_excess=0.0),
)
# Values around a centre of 10 with clusters of equal values (MAD 0: the floored scale), far outliers, exact
# boundary values, and what a metric map may hold that is not a usable number.
VALUE = st.one_of(
    st.sampled_from([10.0, 10.0, 10.0, 9.0, 11.0, 13.5, 6.5, 100.0, -100.0, 0.0, 1e-12]),
    st.floats(min_value=-1e3, max_value=1e3, allow_nan=False),
    st.integers(min_value=-50, max_value=50),
    st.sampled_from([math.nan, math.inf, -math.inf, True, False, "7", None]),
)


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.sampled_from(["actor", "learner"]), st.dictionaries(st.sampled_from(["hi", "lo", "both"]), VALUE)),
        max_size=40,
    ),
    threshold=st.sampled_from([3.5, 1.0, 0.5]),
)
def test_the_column_comparison_reports_what_the_per_sample_one_did(
    rows: list[tuple[str, dict[str, object]]], threshold: float
) -> None:
    samples = [PeerSample(f"w{i:03d}", role, "g", metrics) for i, (role, metrics) in enumerate(rows)]  # type: ignore[arg-type]
    config = FleetConfig(z_threshold=threshold, features=SPECS)
    assert compare(samples, config) == reference(samples, config)
