"""dsec.control.liveness.overdue: which active workers missed lost_after_beats of their own interval."""

from __future__ import annotations

import pytest

from dsec.control.liveness import Beat, overdue
from dsec.model import WorkerState

NOW = 1_000.0


def beat(wid: str, silent_s: float, interval_s: float = 1.0, state: WorkerState = WorkerState.ACTIVE) -> Beat:
    return Beat(worker_id=wid, state=state, last_beat_at=NOW - silent_s, interval_s=interval_s)


def test_no_workers_nothing_overdue() -> None:
    assert overdue([], NOW, 3) == []


@pytest.mark.parametrize(
    ("silent_s", "expected"),
    [
        (0.0, []),
        (2.999, []),
        (3.0, []),  # exactly lost_after_beats intervals: still within the window
        (3.001, ["w"]),
        (1e6, ["w"]),
    ],
)
def test_window_is_lost_after_beats_times_interval(silent_s: float, expected: list[str]) -> None:
    assert overdue([beat("w", silent_s)], NOW, 3) == expected


def test_each_worker_is_judged_by_its_own_interval() -> None:
    beats = [beat("fast", 0.5, interval_s=0.1), beat("slow", 0.5, interval_s=10.0), beat("mid", 2.5, 1.0)]
    assert overdue(beats, NOW, 3) == ["fast"]
    assert overdue(beats, NOW, 2) == ["fast", "mid"]
    assert overdue(beats, NOW, 1) == ["fast", "mid"]
    assert overdue(beats, NOW, 100) == []


@pytest.mark.parametrize("state", [WorkerState.LOST, WorkerState.DEREGISTERED])
def test_only_active_workers_can_become_overdue(state: WorkerState) -> None:
    assert overdue([beat("w", 1e6, state=state)], NOW, 1) == []


def test_order_of_input_is_kept_and_generators_are_accepted() -> None:
    beats = [beat(f"w{i}", 10.0) for i in (3, 1, 2)]
    assert overdue(iter(beats), NOW, 1) == ["w3", "w1", "w2"]


def test_beat_from_the_future_is_not_overdue() -> None:
    # A clock step backwards (NTP) must not make a worker lost.
    assert overdue([beat("w", -50.0)], NOW, 1) == []


def test_beat_is_a_frozen_value() -> None:
    b = beat("w", 1.0)
    with pytest.raises(AttributeError):
        b.last_beat_at = 0.0  # type: ignore[misc]
    assert b == beat("w", 1.0)
