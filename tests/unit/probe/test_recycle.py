"""Drain before the cap (dsec.probe.recycle): a climb into a final allocator limit ends in a written snapshot and a
planned stop, not in the out-of-memory error; nothing happens where the limit can still move, where nothing caps the
allocator, or where there is no snapshot to restart from."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from dsec.probe.recycle import ClimbWatch, MemoryRecycle
from dsec.probe.runtime import Probe


def watch_of(readings: list[tuple[float, float]], horizon_s: float = 2.0) -> ClimbWatch:
    w = ClimbWatch(horizon_s=horizon_s)
    for t, gb in readings:
        w.observe(t, gb)
    return w


CLIMB = [(0.0, 20.0), (0.5, 20.02), (1.0, 20.04), (1.5, 20.06), (2.0, 20.08)]  # 0.04 GB/s, 20.08 GB held now


def test_a_slow_climb_that_reaches_a_limit_at_the_ceiling_within_the_horizon_is_due() -> None:
    w = watch_of(CLIMB)
    assert w.slope_gb_per_s() == pytest.approx(0.04)
    assert w.due(limit_gb=20.15, ceiling_gb=20.15)  # 20.08 + 0.04 x 2 > 20.15
    assert not w.due(limit_gb=20.2, ceiling_gb=20.2)  # not within 2 s
    assert w.due(limit_gb=20.15, ceiling_gb=None)  # no ceiling known: the limit is all there is


def test_a_limit_below_the_ceiling_is_left_to_the_next_quota_plan() -> None:
    assert not watch_of(CLIMB).due(limit_gb=20.15, ceiling_gb=28.0)


def test_a_burst_is_left_to_the_control_plane() -> None:
    burst = [(t / 2, 20.0 + t) for t in range(5)]  # 2 GB/s: the control plane runs its limit past the ceiling
    assert not watch_of(burst).due(limit_gb=24.5, ceiling_gb=24.5)


def test_no_limit_a_flat_or_falling_reading_or_too_few_readings_is_never_due() -> None:
    assert not watch_of(CLIMB).due(limit_gb=None, ceiling_gb=None)
    assert not watch_of([(0.0, 22.0), (1.0, 22.0), (2.0, 22.0)]).due(22.0, 22.0)
    assert not watch_of([(0.0, 23.0), (1.0, 22.5), (2.0, 22.0)]).due(22.0, 22.0)
    assert not watch_of(CLIMB[:2]).due(20.6, 20.6)  # two readings half a second apart: no slope yet
    assert not watch_of(CLIMB, horizon_s=0).due(22.5, 22.5)  # horizon 0: off


def test_readings_closer_than_the_sampling_interval_are_one_reading_at_their_highest() -> None:
    w = ClimbWatch(every_s=0.25)
    for i in range(100):  # 100 optimizer steps within 0.1 s
        w.observe(i * 0.001, 10.0 + i * 0.001)
    assert len(w._samples) == 1 and w._samples[0][0] == 0.0 and w._samples[0][1] == pytest.approx(10.099)


# -- in the probe, on a fake card with snapshots ---------------------------------------------------------------
@pytest.fixture
def make_probe(tmp_path: Path, torch_probe: Callable[[dict[str, str | None]], Probe]) -> Callable[..., Probe]:
    def make(limits: str = "obey", snapshots: bool = True) -> Probe:
        p = torch_probe({
            "DSEC_FAKE_CARD": f"path={tmp_path / 'card0'},memory_gb=4.2,base_gb=4,limits={limits}",
            "DSEC_CHAOS": "memory_growth_mb_per_s=46,max_mb=1024",  # a slow climb: 0.045 GB/s
            "DSEC_SNAPSHOT_DIR": str(tmp_path / "snaps") if snapshots else None,
        })  # fmt: skip
        # A quota at its ceiling: grant 4, limit 4.15 = the worker's ceiling (final: the control plane stops there).
        p.actuators.memory_quota_gb, p.actuators.memory_limit_gb, p.actuators.memory_ceiling_gb = 4.0, 4.15, 4.15
        return p

    return make


def _train(probe: Probe, seconds: float) -> tuple[torch.nn.Module, BaseException | None]:
    """Optimizer steps every 50 ms while the injected growth runs (driven here, as the beats would)."""
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert probe.chaos is not None
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            probe.chaos.poll(lambda _: None)
            opt.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
            time.sleep(0.05)
    except BaseException as exc:
        return model, exc
    return model, None


def test_the_climb_ends_in_a_published_snapshot_and_a_planned_stop_not_an_oom(make_probe: Callable[..., Probe]) -> None:
    probe = make_probe()
    _, stopped = _train(probe, 10.0)
    assert isinstance(stopped, MemoryRecycle), stopped
    assert probe.fake_card is not None and probe.fake_card.ooms == 0
    assert probe.fake_card.held_gb <= 4.15
    snaps = probe.snapshots
    assert snaps is not None and snaps.snapshotter is not None
    report = snaps.snapshotter.restore_latest()  # the state at the stop is what a restart gets back
    assert report is not None and report.step == snaps.steps
    assert "snapshot" in str(stopped) and f"snapshot {report.seq} written" in str(stopped)


@pytest.mark.parametrize(("limits", "snapshots", "fails_at"), [("ignore", True, "the card"), ("obey", False, "limit")])
def test_without_a_cap_or_without_snapshots_the_climb_runs_into_its_oom_as_before(
    make_probe: Callable[..., Probe], limits: str, snapshots: bool, fails_at: str
) -> None:
    _, stopped = _train(make_probe(limits=limits, snapshots=snapshots), 10.0)
    assert isinstance(stopped, torch.OutOfMemoryError), stopped
    assert fails_at in str(stopped)


@pytest.mark.parametrize(("raw", "horizon"), [("0.5", 0.5), ("0", 0.0), ("abc", 2.0), ("inf", 2.0), ("nan", 2.0)])
def test_the_horizon_setting_takes_a_finite_number_and_falls_back_on_anything_else(
    torch_probe: Callable[[dict[str, str | None]], Probe], raw: str, horizon: float
) -> None:
    assert torch_probe({"DSEC_MEMORY_RECYCLE_HORIZON_S": raw}).climb.horizon_s == horizon


# -- a burst into the limit: a snapshot ahead of its out-of-memory error -----------------------------------------
BURST = [(0.0, 20.0), (0.25, 20.1), (0.5, 20.2), (0.75, 20.3)]  # 0.4 GB/s, a sparse-reward rollout's rate


def test_a_burst_rising_into_its_limit_within_the_horizon_is_due_for_a_snapshot_once() -> None:
    w = watch_of(BURST)
    assert w.burst_slope_gb_per_s() == pytest.approx(0.4)
    assert not w.due(limit_gb=21.0, ceiling_gb=21.0)  # not a climb to drain: a burst is let run
    assert not w.burst_due(limit_gb=21.2)  # 20.3 + 0.4 x 2 = 21.1: fits within the horizon
    assert w.burst_due(limit_gb=21.0)
    w.observe(1.0, 20.4)
    assert not w.burst_due(limit_gb=21.0)  # the same burst: snapshotted once
    for t in (1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 2.75, 3.0):
        w.observe(t, 20.4)  # it holds: below the burst line, the burst is over
    assert not w.burst_due(limit_gb=21.0)
    for i, t in enumerate((3.25, 3.5, 3.75, 4.0), start=1):
        w.observe(t, 20.4 + 0.1 * i)
    assert w.burst_due(limit_gb=21.0)  # a new burst


def test_a_burst_whose_limit_was_raised_meanwhile_is_snapshotted_again_near_the_new_one() -> None:
    w = watch_of(BURST)
    assert w.burst_due(limit_gb=21.0)
    assert not w.burst_due(limit_gb=21.0)
    for i, t in enumerate((1.0, 1.25, 1.5, 1.75, 2.0, 2.25), start=1):
        w.observe(t, 20.3 + 0.1 * i)  # the control plane ran the limit past the ceiling: 28 GB now, far off
        assert not w.burst_due(limit_gb=28.0)
    # A card-mate took the room: the bound is 21.5 now, within reach again, and not the 21.0 snapshotted for (that
    # snapshot is 1.5 s of training old).
    assert w.burst_due(limit_gb=21.5)


def test_a_slow_climb_no_limit_or_horizon_0_is_never_due_for_a_burst_snapshot() -> None:
    assert not watch_of(CLIMB).burst_due(limit_gb=20.1)  # 0.04 GB/s: a climb (the drain's), not a burst
    assert not watch_of(BURST).burst_due(limit_gb=None)
    assert not watch_of(BURST, horizon_s=0).burst_due(limit_gb=20.4)
    assert not watch_of(BURST[:2]).burst_due(limit_gb=20.2)  # a quarter second: no slope yet


@pytest.mark.parametrize(("horizon", "fails_at"), [("2", "limit"), ("0", "limit"), ("2", "the card")])
def test_a_burst_that_fails_at_its_limit_restarts_from_a_snapshot_taken_as_it_rose(
    torch_probe: Callable[[dict[str, str | None]], Probe], tmp_path: Path, horizon: str, fails_at: str
) -> None:
    if fails_at == "the card":  # another process (this test's parent: alive) holds 3.5 of the card's 8 GB
        (tmp_path / "card0").write_text(json.dumps({str(os.getppid()): 3.5}))
    probe = torch_probe({
        "DSEC_FAKE_CARD": f"path={tmp_path / 'card0'},memory_gb=8,base_gb=4,limits=obey",
        "DSEC_CHAOS": "memory_growth_mb_per_s=410,max_mb=2048",  # a 0.4 GB/s burst, up to 2 GB
        "DSEC_SNAPSHOT_DIR": str(tmp_path / "snaps"),  # no interval: no periodic snapshot
        "DSEC_MEMORY_RECYCLE_HORIZON_S": horizon,
    })  # fmt: skip
    # Past the ceiling (a burst's limit runs into free memory), but not as far as this burst goes; or a limit past
    # the card's room (4.5 GB left beside the other process): the card binds first.
    limit = 5.0 if fails_at == "limit" else 7.5
    probe.actuators.memory_quota_gb, probe.actuators.memory_limit_gb, probe.actuators.memory_ceiling_gb = (
        4.0,
        limit,
        4.5,
    )
    _, stopped = _train(probe, 10.0)
    assert isinstance(stopped, torch.OutOfMemoryError) and fails_at in str(stopped), stopped
    snaps = probe.snapshots
    assert snaps is not None and snaps.snapshotter is not None
    snaps.snapshotter.wait_idle(30.0)
    report = snaps.snapshotter.restore_latest()
    if horizon == "0":
        assert report is None  # off: the restart would go back to the last periodic snapshot (none here)
        return
    # ~2.5 s of rise into a 1 GB gap at 50 ms a step: the snapshot came within the last few dozen steps, not before it.
    assert report is not None and 0 < snaps.steps - report.step <= 40, (snaps.steps, report.step)
