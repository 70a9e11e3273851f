"""Pools and devices: the control plane's inventory, stored and mirrored in the hot state."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from dsec.control import errors
from dsec.control.access import Access
from dsec.control.eventlog import DurableLog
from dsec.control.ports import Clock
from dsec.control.state import HotState
from dsec.control.store import Store, WriteBatch
from dsec.model import Device, Event, EventType, Pool, WorkerState


class PoolsAndDevices:
    def __init__(self, state: HotState, store: Store, log: DurableLog, access: Access, clock: Clock) -> None:
        self.state = state
        self.store = store
        self.log = log
        self.access = access
        self.clock = clock

    async def put_pool(self, pool: Pool, actor: str = "api", events: Sequence[Event] = ()) -> Pool:
        """The pool, its ``pool_changed`` event and ``events`` (the policy action that changed it) in one transaction,
        through the writer: none without the others."""
        now = self.clock()
        created = pool.name not in self.state.pools
        data = {"created": created, "spec": pool.to_dict(), "by": actor}
        written = [Event(ts=now, type=EventType.POOL_CHANGED, pool=pool.name, data=data), *events]
        await self.log.commit(WriteBatch(pools=[(pool, now)], events=written))
        self.state.pools[pool.name] = pool
        self.log.observe(written)
        return pool

    async def delete_pool(self, name: str, actor: str = "api") -> None:
        if name not in self.state.pools:
            raise errors.not_found("pool", name, "name")
        busy = [w.id for w in self.state.workers.values() if w.pool == name and w.state is not WorkerState.DEREGISTERED]
        if busy:
            raise errors.conflict(f"pool {name!r} still has {len(busy)} registered worker(s)", "name")
        ev = Event(ts=self.clock(), type=EventType.POOL_CHANGED, pool=name, data={"deleted": True, "by": actor})
        # Its pool tokens go with it, and its event, in one transaction.
        await self.log.commit(WriteBatch(deleted_pools=[name], events=[ev]))
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

    async def put_device(self, device: Device, events: Sequence[Event] = ()) -> Device:
        """The device and ``events`` (e.g. the health change it records) in one transaction."""
        await self.log.commit(WriteBatch(devices=[(device, self.clock())], events=list(events)))
        self.state.devices[device.id] = device
        self.log.observe(events)
        return device
