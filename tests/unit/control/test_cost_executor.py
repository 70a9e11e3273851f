"""dsec.control.cost: live workers and retired ones as the accounting sees them; the price setting."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsec.control.cost import retired_records, worker_record
from dsec.control.settings import Settings
from dsec.control.state import LiveWorker
from dsec.model import Directive, DirectiveFields, Event, EventType, WorkerInfo, WorkerState


def live(state: WorkerState = WorkerState.ACTIVE, device: str | None = "gpu-0", **metrics: float) -> LiveWorker:
    return LiveWorker(
        id="w-1",
        info=WorkerInfo(pool="p", group="g", device=device),
        state=state,
        token_hash="h",
        registered_at=10.0,
        last_beat_at=50.0,
        last_seq=3,
        acked_version=1,
        beats=3,
        metrics=metrics,
        directive=Directive("w-1", 1, DirectiveFields(), 10.0),
    )


def test_a_live_worker_record() -> None:
    r = worker_record(live(updates_total=5.0, step_ms_mean=40.0))
    assert (r.pool, r.group, r.registered_at, r.ended_at, r.devices, r.progressed, r.step_ms) == (
        "p", "g", 10.0, None, 1, True, 40.0,
    )  # fmt: skip


def test_no_device_is_unknown_and_no_progress_counter_is_no_progress() -> None:
    r = worker_record(live(device=None, memory_used_gb=1.0, updates_total=0.0))
    assert r.devices is None and r.progressed is False and r.step_ms is None


def test_a_deregistered_worker_ends_at_its_end_else_its_last_beat() -> None:
    w = live(WorkerState.DEREGISTERED)
    assert worker_record(w).ended_at == 50.0
    w.ended_at = 42.0
    assert worker_record(w).ended_at == 42.0


def test_retired_workers_come_back_from_their_registrations() -> None:
    events = [
        Event(ts=5.0, type=EventType.REGISTERED, worker_id="w-old", pool="p", data={"group": "ppo"}),
        Event(ts=6.0, type=EventType.REGISTERED, worker_id="w-1", pool="p", data={}),  # still live: skipped
        Event(ts=7.0, type=EventType.REGISTERED, worker_id="w-q", pool="q", data={}),
    ]
    (r,) = retired_records(events, {"w-1"}, "p")
    assert (r.id, r.group, r.registered_at, r.devices, r.progressed) == ("w-old", "ppo", 5.0, None, None)
    assert [x.id for x in retired_records(events, {"w-1"}, None)] == ["w-old", "w-q"]


def test_the_price_comes_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings.from_env(home=tmp_path).cost_device_hour == 0.0
    monkeypatch.setenv("DSEC_COST_DEVICE_HOUR", "2.75")
    assert Settings.from_env(home=tmp_path).cost_device_hour == 2.75
    monkeypatch.setenv("DSEC_COST_DEVICE_HOUR", "cheap")
    with pytest.raises(ValueError, match="DSEC_COST_DEVICE_HOUR"):
        Settings.from_env(home=tmp_path)
    monkeypatch.setenv("DSEC_COST_DEVICE_HOUR", "-1")
    with pytest.raises(ValueError, match="cost_device_hour"):
        Settings.from_env(home=tmp_path)


def test_the_breakers_memory_path_is_off_unless_the_environment_turns_it_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DSEC_MEMORY_PRESSURE", raising=False)
    assert Settings.from_env(home=tmp_path).judge is None  # JudgeConfig's default: memory_pressure None
    monkeypatch.setenv("DSEC_MEMORY_PRESSURE", "0.9")
    judge = Settings.from_env(home=tmp_path).judge
    assert judge is not None and judge.memory_pressure == 0.9
    for bad in ("high", "1.5", "0", "nan"):
        monkeypatch.setenv("DSEC_MEMORY_PRESSURE", bad)
        with pytest.raises(ValueError, match="DSEC_MEMORY_PRESSURE"):
            Settings.from_env(home=tmp_path)


def test_room_for_bursts_is_on_unless_the_environment_turns_it_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dsec.control.judge import JudgeConfig

    monkeypatch.delenv("DSEC_MEMORY_PRESSURE", raising=False)
    monkeypatch.delenv("DSEC_MAKE_ROOM", raising=False)
    assert Settings.from_env(home=tmp_path).judge is None  # JudgeConfig's default: make_room on
    monkeypatch.setenv("DSEC_MAKE_ROOM", "0")
    judge = Settings.from_env(home=tmp_path).judge
    assert judge is not None and judge.make_room is False and judge.memory_pressure is None
    monkeypatch.setenv("DSEC_MEMORY_PRESSURE", "0.9")  # both variables apply together
    judge = Settings.from_env(home=tmp_path).judge
    assert judge is not None and (judge.make_room, judge.memory_pressure) == (False, 0.9)
    explicit = JudgeConfig(quota_interval_s=0.5)  # an explicit JudgeConfig wins over the environment
    assert Settings.from_env(home=tmp_path, judge=explicit).judge is explicit
    monkeypatch.setenv("DSEC_MAKE_ROOM", "perhaps")
    with pytest.raises(ValueError, match="DSEC_MAKE_ROOM"):
        Settings.from_env(home=tmp_path)
