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
from dsec.scheduler.device_health import DeviceHealthConfig

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
