"""State a restarted control plane rebuilds from the stored events instead of starting over: a degraded device's
probation clock and its pool's policy hold run from the degradation, not from the restart. A real ControlPlane over
a real SQLite store (no server: the state is read directly)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import make_settings
from dsec.control.service import ControlPlane
from dsec.control.store import Store, WriteBatch, open_store
from dsec.model import Device, DeviceHealth, Event, EventType, Pool
from dsec.quota.trend import BURST_HOLD_S
from dsec.scheduler.device_health import DeviceHealthConfig
from dsec.scheduler.placement import GroupSpec, JobSpec, WorkerSpec

T0 = 1_800_000_000.0
CONFIG = DeviceHealthConfig(probation_after_s=60.0, recovery_hold_s=120.0)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = open_store(f"sqlite:///{tmp_path / 'home' / 'dsec.db'}")  # the database make_settings(home) names
    try:
        yield s
    finally:
        s.close()


def degraded(device: str, pool: str, ts: float) -> Event:
    data = {"kind": "health", "device": device, "from": "healthy", "to": "degraded", "why": "test"}
    return Event(ts=ts, type=EventType.DEVICE, pool=pool, data=data)


async def test_a_degradation_before_the_restart_keeps_its_clocks(store: Store, tmp_path: Path) -> None:
    store.put_pool(Pool("pool-a"), T0)
    store.put_pool(Pool("pool-b"), T0)
    store.put_devices([Device("gpu-0", "n0", health=DeviceHealth.DEGRADED, pool="pool-a"),
                       Device("gpu-1", "n0", health=DeviceHealth.DEGRADED, pool="pool-b")], T0)  # fmt: skip
    # gpu-0 degraded 100 s before the restart; gpu-1 an hour before (its pool's hold is over).
    store.write(WriteBatch(events=[degraded("gpu-1", "pool-b", T0 - 3600), degraded("gpu-0", "pool-a", T0 - 100)]))
    now = T0
    settings = make_settings(tmp_path / "home", device_health=CONFIG)
    cp = ControlPlane(settings, store, clock=lambda: now)
    try:
        # The pool is held for recovery_hold_s from the degradation: 20 s more, not 120 s from now.
        assert cp.state.pool_recovering_until == {"pool-a": T0 - 100 + 120.0, "pool-b": T0 - 3600 + 120.0}
        assert cp.policies._suppressed("pool-a") and not cp.policies._suppressed("pool-b")
        # Both devices are empty and were degraded longer than probation_after_s ago: probation at the first pass.
        await cp.scheduler.tick(now)
        assert {d: cp.state.devices[d].health for d in ("gpu-0", "gpu-1")} == dict.fromkeys(
            ("gpu-0", "gpu-1"), DeviceHealth.PROBATION
        )
    finally:
        cp.close()


def room(card: str, device: str, ts: float) -> Event:
    data = {"kind": "make_room", "card": card, "device": device, "projected_gb": 2.4, "bursting": ["w-learner"],
            "until": ts + BURST_HOLD_S, "reason": "test"}  # fmt: skip
    return Event(ts=ts, type=EventType.ROOM, pool="pool-a", worker_id="w-actor", data=data)


async def test_room_made_for_a_burst_before_the_restart_is_still_held(store: Store, tmp_path: Path) -> None:
    """A card holding room for a burst keeps it across a restart, until the hold the event recorded: placement still
    leaves its free slots out (and the judge, which reads the same holds, asks the card for no second move)."""
    store.put_pool(Pool("pool-a", devices=("c0-a", "c0-b", "c1-a", "gpu-9")), T0)
    slots = {"c0-a": ("n0", "card0"), "c0-b": ("n0", "card0"), "c1-a": ("n0", "card1"), "gpu-9": ("n1", None)}
    store.put_devices([Device(d, node, memory_gb=16, pool="pool-a", card=card) for d, (node, card) in slots.items()],
                      T0)  # fmt: skip
    # card0's room was made 100 s before the restart (held 200 s more); card1's hold ended before it.
    store.write(WriteBatch(events=[room("card1", "c1-a", T0 - BURST_HOLD_S - 10), room("card0", "c0-a", T0 - 100)]))
    now = T0
    cp = ControlPlane(make_settings(tmp_path / "home"), store, clock=lambda: now)
    try:
        assert cp.state.room_until == {"card0": T0 - 100 + BURST_HOLD_S}
        job = JobSpec("j", (GroupSpec("g", (WorkerSpec("g-0", memory_gb=1.0),)),), pool="pool-a")
        assert set(cp.scheduler._room_held(job)) == {"c0-a", "c0-b"}
        placement = await cp.scheduler.place(job)
        assert placement.assignments[0].device in {"c1-a", "gpu-9"}
        assert "keeps room for a memory burst" in placement.excluded["c0-b"]
    finally:
        cp.close()
