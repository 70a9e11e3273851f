"""dsec.backoff: the one retry-delay formula, and that the retry loops use it."""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path

import pytest

from dsec.backoff import Backoff
from dsec.control.runtimes import RetryPolicy

SRC = Path(__file__).resolve().parents[2] / "src" / "dsec"


def test_nominal_delay_grows_by_factor_and_stops_at_the_cap() -> None:
    b = Backoff(initial_s=0.25, factor=2.0, max_s=30.0)
    assert [b.nominal(n) for n in range(4)] == [0.25, 0.5, 1.0, 2.0]
    assert b.nominal(7) == 30.0  # 0.25 * 128 = 32, capped
    assert b.nominal(100_000) == 30.0  # 2.0 ** 100000 overflows a float: still the cap


def test_zero_initial_delay_stays_zero_however_many_attempts() -> None:
    assert Backoff(initial_s=0.0, max_s=5.0).nominal(100_000) == 0.0


@pytest.mark.parametrize("jitter", [0.0, 0.25, 0.5, 1.0])
def test_delay_lies_between_the_fixed_share_and_the_nominal_delay(jitter: float) -> None:
    b = Backoff(initial_s=0.1, factor=3.0, max_s=10.0, jitter=jitter)
    rng = random.Random(7)
    for attempt in range(12):
        nominal = b.nominal(attempt)
        for _ in range(200):
            d = b.delay(attempt, rng)
            assert nominal * (1 - jitter) <= d <= nominal


def test_default_is_equal_jitter_and_actually_spreads() -> None:
    b = Backoff(initial_s=1.0, max_s=1.0)
    draws = [b.delay(0, random.Random(seed)) for seed in range(200)]
    assert min(draws) >= 0.5
    assert min(draws) < 0.55 and max(draws) > 0.95  # the whole upper half is used, not one point


def test_same_seed_same_delays() -> None:
    b = Backoff(initial_s=0.5)
    assert [b.delay(n, random.Random(3)) for n in range(5)] == [b.delay(n, random.Random(3)) for n in range(5)]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_s": -1.0},
        {"initial_s": float("nan")},
        {"initial_s": 1.0, "factor": 0.5},
        {"initial_s": 1.0, "max_s": float("inf")},
        {"initial_s": 1.0, "jitter": 1.5},
        {"initial_s": 1.0, "jitter": -0.1},
    ],
)
def test_invalid_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="is invalid"):
        Backoff(**kwargs)


def test_negative_attempt_is_refused() -> None:
    with pytest.raises(ValueError, match="attempt=-1"):
        Backoff(initial_s=1.0).delay(-1, random.Random(0))


def test_webhook_retry_policy_keeps_its_configured_fields_and_counts_retries_from_one() -> None:
    assert [f.name for f in dataclasses.fields(RetryPolicy)] == ["max_attempts", "base_s", "max_s", "timeout_s"]
    policy = RetryPolicy(base_s=0.5, max_s=4.0)
    rng = random.Random(1)
    for _ in range(100):
        assert 0.25 <= policy.delay(1, rng) <= 0.5  # the first retry waits about base_s
        assert 2.0 <= policy.delay(10, rng) <= 4.0  # capped at max_s


@pytest.mark.parametrize(
    "module", ["probe/reporter.py", "probe/heal_client.py", "control/runtimes.py", "alerts/sinks.py"]
)
def test_retry_loops_draw_their_jitter_from_backoff(module: str) -> None:
    text = (SRC / module).read_text(encoding="utf-8")
    assert "Backoff(" in text or ".backoff" in text
    assert ".uniform(" not in text  # a second jitter formula
