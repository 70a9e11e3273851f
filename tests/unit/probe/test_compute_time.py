"""compute_ms_p50: the time between optimizer steps that a rank did not spend blocked on its gradient sync — the
signal device health judges a card by (a slow link or a late peer makes the sync slower, not the compute). The median
of the interval's steps: an RL learner's rollout falls between two of its optimizer steps once per update."""

from __future__ import annotations

import pytest

from dsec.probe.telemetry import Telemetry


def test_the_wait_for_the_last_bucket_is_not_compute() -> None:
    t = Telemetry()
    t.record_update(0.002, None, now=10.0)  # the first step only starts the clock
    t.record_sync(1000, 0.010, True)  # an early bucket: overlapped with the backward pass
    t.record_sync(1000, 0.030, True, last=True)  # the training thread waits this one out
    t.record_update(0.002, None, now=10.100)
    t.record_sync(1000, 0.050, True, last=True)  # a slower sync (the link, a late peer): same compute
    t.record_update(0.002, None, now=10.220)
    t.record_sync(1000, 0.030, True, last=True)
    t.record_update(0.002, None, now=11.150)  # 900 ms between these steps: a rollout
    out = t.collect()
    assert out["compute_ms_p50"] == pytest.approx(70.0)
    assert out["compute_ms_p99"] == pytest.approx(900.0)
    assert "compute_ms_p50" not in t.collect()  # per interval: nothing new, nothing reported


def test_a_step_without_sync_is_all_compute_and_unattributed_syncs_are_left_out() -> None:
    t = Telemetry()
    t.record_update(0.002, None, now=0.0)
    t.record_update(0.002, None, now=0.040)  # one process, no gradient sync: the whole interval
    t.record_sync(1000, 0.500, True)  # a sync path that does not say which bucket the thread waits for
    t.record_update(0.002, None, now=1.0)  # left out: counting its wait as compute would blame the device
    assert t.collect()["compute_ms_p50"] == pytest.approx(40.0)


def test_a_wait_longer_than_the_interval_counts_as_no_compute() -> None:
    t = Telemetry()
    t.record_update(0.001, None, now=0.0)
    t.record_sync(1000, 0.2, True, last=True)
    t.record_update(0.001, None, now=0.1)
    assert t.collect()["compute_ms_p50"] == 0.0


def test_compute_is_per_backward_pass_under_gradient_accumulation() -> None:
    # A group at the breaker's level 2 steps its optimizer every 4th backward pass: per pass it computes as fast.
    t = Telemetry()
    t.record_update(0.002, None, now=0.0, micro_steps=4)
    t.record_sync(1000, 0.020, True, last=True)
    t.record_update(0.002, None, now=0.300, micro_steps=4)
    assert t.collect()["compute_ms_p50"] == pytest.approx(70.0)
