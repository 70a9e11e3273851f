"""The pure degraded-device state machine (scheduler/device_health.py) the control plane and the simulator share."""

from __future__ import annotations

from dsec.model import DeviceHealth
from dsec.scheduler.device_health import DeviceHealthConfig, DeviceHealthTracker, Occupancy

H, D, P = DeviceHealth.HEALTHY, DeviceHealth.DEGRADED, DeviceHealth.PROBATION
CFG = DeviceHealthConfig(degrade_after_s=3.0, probation_after_s=60.0, probation_s=60.0)


def test_all_judged_workers_slow_for_long_enough_degrades() -> None:
    tr = DeviceHealthTracker(CFG)
    slow = {"a": Occupancy(workers=4, judged=4, slow=4)}
    assert tr.step(0.0, {"a": H}, slow) == []
    assert tr.step(2.9, {"a": H}, slow) == []
    [change] = tr.step(3.0, {"a": H}, slow)
    assert (change.device, change.before, change.after, change.degraded) == ("a", H, D, True)


def test_one_fast_worker_or_a_pause_resets_the_clock() -> None:
    tr = DeviceHealthTracker(CFG)
    tr.step(0.0, {"a": H}, {"a": Occupancy(4, 4, 4)})
    assert tr.step(2.0, {"a": H}, {"a": Occupancy(4, 4, 3)}) == []
    assert tr.step(4.0, {"a": H}, {"a": Occupancy(4, 4, 4)}) == []  # starts over at 4.0
    assert tr.step(6.9, {"a": H}, {"a": Occupancy(4, 4, 4)}) == []
    assert tr.step(7.0, {"a": H}, {"a": Occupancy(4, 4, 4)})[0].after is D


def test_an_unjudged_worker_does_not_veto_but_no_judged_worker_is_no_evidence() -> None:
    # A single learner (no peers to compare with) shares the card with three slow actors: the card is judged by them.
    tr = DeviceHealthTracker(CFG)
    occ = {"a": Occupancy(workers=4, judged=3, slow=3)}
    tr.step(0.0, {"a": H}, occ)
    assert tr.step(3.0, {"a": H}, occ)[0].after is D
    # Only unjudged workers: nothing to go on.
    tr2 = DeviceHealthTracker(CFG)
    none = {"a": Occupancy(workers=1, judged=0, slow=0)}
    assert tr2.step(0.0, {"a": H}, none) == [] and tr2.step(100.0, {"a": H}, none) == []


def test_probation_after_quiet_then_healthy_after_a_clean_run_or_degraded_again() -> None:
    tr = DeviceHealthTracker(CFG)
    tr.step(0.0, {"a": H}, {"a": Occupancy(1, 1, 1)})
    assert tr.step(3.0, {"a": H}, {"a": Occupancy(1, 1, 1)})[0].after is D
    assert tr.step(30.0, {"a": D}, {"a": Occupancy(1, 1, 1)}) == []  # not empty: no probation
    assert tr.step(62.0, {"a": D}, {}) == []  # empty, but only since it degraded at 3.0 + 60 > 62
    assert tr.step(63.0, {"a": D}, {})[0].after is P
    assert tr.step(70.0, {"a": P}, {"a": Occupancy(1, 1, 0)}) == []
    assert tr.step(130.0, {"a": P}, {"a": Occupancy(1, 1, 0)})[0].after is H
    tr.step(200.0, {"a": P}, {})  # (a different history) on probation and flagged again: degraded at once
    tr3 = DeviceHealthTracker(CFG)
    assert tr3.step(0.0, {"b": P}, {"b": Occupancy(2, 2, 2)})[0].after is D


def test_a_device_found_degraded_after_a_restart_starts_its_probation_wait_then() -> None:
    tr = DeviceHealthTracker(CFG)  # no history: e.g. the control plane restarted
    assert tr.step(1000.0, {"a": D}, {}) == []
    assert tr.step(1059.0, {"a": D}, {}) == []
    assert tr.step(1060.0, {"a": D}, {})[0].after is P
