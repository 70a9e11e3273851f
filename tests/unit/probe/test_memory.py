"""The probe's memory growth estimate (memory_growth_gb_per_h)."""

from __future__ import annotations

import random

import pytest

from dsec.probe.memory import MIN_SAMPLES, MemoryTrend, growth_gb_per_h

T0 = 1_000_000.0  # monotonic clocks start anywhere: the estimate must not care


def test_flat_memory_grows_by_nothing() -> None:
    samples = [(T0 + 15 * i, 6.0) for i in range(40)]
    assert growth_gb_per_h(samples) == pytest.approx(0.0, abs=1e-9)


def test_one_gb_over_half_an_hour_is_two_gb_per_hour() -> None:
    samples = [(T0 + 60 * i, 4.0 + i / 30) for i in range(31)]
    assert growth_gb_per_h(samples) == pytest.approx(2.0)


def test_noise_averages_out_and_a_single_spike_does_not_read_as_a_leak() -> None:
    rng = random.Random(7)
    samples = [(T0 + 5 * i, 4.0 + 0.5 * (5 * i) / 3600 + rng.gauss(0, 0.05)) for i in range(120)]
    assert growth_gb_per_h(samples) == pytest.approx(0.5, abs=0.35)
    spiky = [(T0 + 5 * i, 4.0 + (1.0 if i == 119 else 0.0)) for i in range(120)]
    assert abs(growth_gb_per_h(spiky) or 0.0) < 0.3  # (last - first) over 10 min would say 6 GB/h


def test_too_few_samples_or_too_short_a_span_report_nothing() -> None:
    assert growth_gb_per_h([(T0 + 30 * i, float(i)) for i in range(MIN_SAMPLES - 1)]) is None
    assert growth_gb_per_h([(T0 + 10 * i, float(i)) for i in range(6)]) is None  # 50 s
    assert growth_gb_per_h([(T0 + 12 * i, float(i)) for i in range(6)]) is not None  # 60 s
    assert growth_gb_per_h([]) is None


def test_the_trend_keeps_the_last_ten_minutes() -> None:
    now = [T0]
    trend = MemoryTrend(clock=lambda: now[0])
    readings = []
    for i in range(62):  # at 20 s: 2 GB/h for 10 min, then flat for 10 min and more
        now[0] = T0 + 20 * i
        readings.append(trend.add(1.0 + min(i, 30) * 20 * 2.0 / 3600))
    assert readings[:3] == [None, None, None]
    assert readings[25] == pytest.approx(2.0)
    assert readings[-1] == pytest.approx(0.0, abs=1e-9), "the leak left the window"
