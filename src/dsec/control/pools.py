"""Pools and devices: the control plane's inventory, stored and mirrored in the hot state."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from dsec.control import errors
from dsec.control.access import Access
from dsec.control.eventlog import DurableLog
from dsec.control.ports import Clock
from dsec.control.state import HotState
from dsec.control.store import Store
from dsec.model import Device, Event, EventType, Pool, WorkerState


class PoolsAndDevices:
    def __init__(self, state: HotState, store: Store, log: DurableLog, access: Access, clock: Clock) -> None:
        self.state = state
        self.store = store
        self.log = log
        self.access = access
        self.clock = clock

    async def put_pool(self, pool: Pool, actor: str = "api") -> Pool:
        now = self.clock()
        created = pool.name not in self.state.pools
        await asyncio.to_thread(self.store.put_pool, pool, now)
        self.state.pools[pool.name] = pool
        await self.log.record_events(
            [
                Event(
                    ts=now,
                    type=EventType.POOL_CHANGED,
                    pool=pool.name,
                    data={"created": created, "spec": pool.to_dict(), "by": actor},
                )
            ]
        )
        return pool

    async def delete_pool(self, name: str) -> None:
        if name not in self.state.pools:
            raise errors.not_found("pool", name, "name")
        busy = [w.id for w in self.state.workers.values() if w.pool == name and w.state is not WorkerState.DEREGISTERED]
        if busy:
            raise errors.conflict(f"pool {name!r} still has {len(busy)} registered worker(s)", "name")
        await asyncio.to_thread(self.store.delete_pool, name)  # its pool tokens go with it, in one transaction
        del self.state.pools[name]
        self.access.forget_pool(name)

    def apply_cluster(self, pools: Iterable[Pool], devices: Iterable[Device]) -> None:
        """Startup path for ``--cluster``: the file wins over what the store holds for the same names."""
        now = self.clock()
        devs = list(devices)
        for p in pools:
            self.store.put_pool(p, now)
            self.state.pools[p.name] = p
        self.store.put_devices(devs, now)
        self.state.devices.update({d.id: d for d in devs})

    async def put_device(self, device: Device) -> Device:
        await asyncio.to_thread(self.store.put_devices, [device], self.clock())
        self.state.devices[device.id] = device
        return device
