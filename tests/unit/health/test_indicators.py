"""Streaming health indicators against values computed by hand."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from dsec.health.indicators import Percentiles, RollingCV, TrendSlope, VarianceShift


def test_rolling_cv_matches_statistics_over_the_window() -> None:
    cv = RollingCV(window=5)
    assert cv.value() is None
    for x in [100, 1, 2, 3, 4, 5]:
        cv.add(x)
    assert cv.value() == pytest.approx(statistics.stdev([1, 2, 3, 4, 5]) / 3)


def test_variance_shift_sees_a_variance_change_and_not_a_constant_one() -> None:
    rng = random.Random(0)
    vs = VarianceShift(recent=20, reference=60)
    for _ in range(80):
        vs.add(rng.gauss(0, 1))
    calm = vs.value()
    assert calm is not None and abs(calm) < 1.0
    for _ in range(20):
        vs.add(rng.gauss(0, 4))
    shifted = vs.value()
    assert shifted is not None and shifted > math.log(4)


def test_trend_slope_is_the_least_squares_slope() -> None:
    ts = TrendSlope(window=10)
    for i in range(10):
        ts.add(3.0 - 0.5 * i)
    assert ts.value() == pytest.approx(-0.5)


def test_percentiles_nearest_rank_and_reset() -> None:
    p = Percentiles()
    for x in range(1, 101):
        p.add(float(x))
    assert p.take() == {"p50": 50.0, "p95": 95.0, "p99": 99.0}
    assert p.take() == {}
