"""probe/cadence.py: a learner's snapshot interval from its group's failure history and its measured snapshot cost."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest

from dsec.decide.cadence import snapshot_interval_s
from dsec.job_history import REFRESH_S, GroupHistory, write_history
from dsec.probe.cadence import SnapshotCadence


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_fixed_is_the_default_and_bad_values_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    assert SnapshotCadence.from_env({}) is None
    assert SnapshotCadence.from_env({"DSEC_SNAPSHOT_CADENCE": "fixed"}) is None
    with caplog.at_level(logging.ERROR):
        assert SnapshotCadence.from_env({"DSEC_SNAPSHOT_CADENCE": "sometimes"}) is None
        bad = SnapshotCadence.from_env({"DSEC_SNAPSHOT_CADENCE": "failure_history", "DSEC_SNAPSHOT_HISTORY": "x:-1"})
    assert "DSEC_SNAPSHOT_CADENCE='sometimes'" in caplog.text and "DSEC_SNAPSHOT_HISTORY='x:-1'" in caplog.text
    assert bad is not None and (bad.exposure_s, bad.rollbacks) == (0.0, 0)  # no history, still adaptive
    ok = SnapshotCadence.from_env({"DSEC_SNAPSHOT_CADENCE": "failure_history", "DSEC_SNAPSHOT_HISTORY": "3600.5:2"})
    assert ok is not None and (ok.exposure_s, ok.rollbacks) == (3600.5, 2)


def test_the_configured_interval_until_a_cost_is_measured_then_youngs_with_the_history() -> None:
    clock = Clock()
    c = SnapshotCadence(86_400.0, 1, clock=clock)
    assert c.interval(90.0) == 90.0 and c.interval(None) is None  # nothing measured yet
    for ms in (200.0, 250.0, 5000.0):  # one slow write does not set the cost
        c.observe({"total_ms": ms})
    c.observe({"total_ms": "fast"})  # not a number: ignored
    assert c.cost_s() == 0.25
    assert c.interval(90.0) == pytest.approx(snapshot_interval_s(0.25, 86_400.0, 1, 90.0))
    assert c.interval(90.0) == pytest.approx(math.sqrt(2 * 0.25 * (86_400 + 16_200) / 2))  # ~160 s
    clock.now += 3600.0  # this process's own hour counts
    assert c.interval(90.0) == pytest.approx(snapshot_interval_s(0.25, 90_000.0, 1, 90.0))
    assert c.interval(None) is None  # no period configured anywhere: none invented


def test_the_job_s_other_groups_from_the_supervisor_s_file_sharpen_the_prior(tmp_path: Path) -> None:
    clock, wall = Clock(), Clock()
    path = tmp_path / "history" / "j.json"
    write_history(path, {"g": GroupHistory(500.0, 3, True), "h": GroupHistory(7_200.0, 0, True)}, written_at=wall.now)
    env = {"DSEC_SNAPSHOT_CADENCE": "failure_history", "DSEC_SNAPSHOT_HISTORY": "500:0",
           "DSEC_SNAPSHOT_JOB_HISTORY": str(path), "DSEC_GROUP": "g"}  # fmt: skip
    c = SnapshotCadence.from_env(env)
    assert c is not None
    c._clock, c._wall, c._t0 = clock, wall, clock.now
    c.observe({"total_ms": 250.0})
    # g's own entry in the file is not a peer: only h's two hours.
    assert c.interval(90.0) == pytest.approx(snapshot_interval_s(0.25, 500.0, 0, 90.0, peers=(7_200.0, 0)))
    assert c.interval(90.0) > snapshot_interval_s(0.25, 500.0, 0, 90.0)
    # h rolls back twice; the file is re-read only after REFRESH_S.
    write_history(path, {"h": GroupHistory(7_300.0, 2, True)}, written_at=wall.now)
    wall.now += REFRESH_S / 2
    assert c.peers() == (7_200.0, 0)
    wall.now += REFRESH_S
    assert c.peers() == (7_300.0 + REFRESH_S * 1.5, 2)  # read at 1.5 x REFRESH_S after its write
    path.unlink()  # the supervisor's file gone: no peers, the group's own history alone
    wall.now += REFRESH_S
    assert c.peers() == (0.0, 0)
    assert c.interval(90.0) == pytest.approx(snapshot_interval_s(0.25, 500.0, 0, 90.0))
