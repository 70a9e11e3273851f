"""``sample_values`` (what a beat's judgment hands the breaker) is ``sample_from(...).values()`` without the
``Sample``, and a breaker that observes the values ends where one that observes the ``Sample`` does."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.breaker import Breaker, BreakerConfig, Caps
from dsec.decide.caps import sample_from, sample_values

SIGNALS = ["grad_upload_bytes_per_s", "sync_cost_ms_p50", "sync_latency_ms_p50", "memory_used_gb", "gpu_util"]
VALUES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(0, 500),
    st.integers(-(2**70), 2**70),
    st.sampled_from([True, False, None, "12", 1.7976931348623157e308, -0.0, 0]),
)
METRICS = st.dictionaries(st.sampled_from(SIGNALS), VALUES, max_size=5)


@settings(max_examples=1500, deadline=None)
@given(metrics=METRICS)
def test_sample_values_are_the_samples_values(metrics: dict[str, Any]) -> None:
    expected = sample_from(metrics, 1.0).values()
    got = sample_values(metrics)
    assert got == expected and list(got) == list(expected)
    assert all(type(v) is float and math.isfinite(v) for v in got.values())


@settings(max_examples=300, deadline=None)
@given(beats=st.lists(st.tuples(st.floats(0, 2), METRICS), max_size=12))
def test_a_breaker_observing_values_ends_where_one_observing_samples_does(
    beats: list[tuple[float, dict[str, Any]]],
) -> None:
    config = BreakerConfig(window_s=3.0, min_samples=2, recovery_s=1.0, max_recovery_s=4.0)
    caps = Caps(bandwidth_mbps=100.0, latency_ms=50.0, memory_gb=8.0)
    a, b = Breaker(config), Breaker(config)
    now = 0.0
    for dt, metrics in beats:
        now += dt
        a.observe(sample_from(metrics, now), caps)
        b.observe_values(now, sample_values(metrics), caps)
        ta, tb = a.decide(now, caps, 0), b.decide(now, caps, 0)
        assert (ta and ta.to_dict()) == (tb and tb.to_dict())
        assert a == b
