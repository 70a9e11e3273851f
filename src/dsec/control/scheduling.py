"""Scheduling inside the control plane: placements with explanations, device personalities learned from history,
and degraded-device detection with probation.

- **Placements** (``POST /v1/placements``): the job is placed on the control plane's inventory (its devices, their
  health, the pool's devices and ``gpu_quota``, devices other placements hold) with the learned profiles; the result
  with its per-term scores is kept (``GET /v1/placements/{job}``) and recorded as a ``placement`` event.
- **Profiles**: when a worker ends (deregistered or lost) on a device, a ``device`` event of kind ``run`` records how
  it went (OOM, failure, throttling, memory leak rate, sync jitter, load class); at startup the profiles are
  rebuilt from those events, so they persist across restarts.
- **Device health**: a device whose workers are all fleet outliers on step time or sync lag (the judge's robust
  median/MAD comparison) for ``degrade_after_s`` becomes *degraded*: no new placements, its workers get
  ``snapshot_now`` (the launcher then moves them from that snapshot), its pool's policy actions are held back while
  it recovers. After ``probation_after_s`` without a worker it goes on *probation* (placeable, with a penalty);
  once a worker has run on it for ``probation_s`` without being flagged it is *healthy* again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from dsec.control.store import PlacementRow, WriteBatch
from dsec.decide import degrade, occupancy, slow_workers
from dsec.model import Device, DeviceHealth, Event, EventType, Pool, WorkerState
from dsec.quota.trend import BURST_HOLD_S
from dsec.scheduler.device_health import DeviceHealthConfig, DeviceHealthTracker
from dsec.scheduler.inventory import Inventory, from_cluster
from dsec.scheduler.placement import JobSpec, Placement, place, placement_from_dict
from dsec.scheduler.profiles import Profiles, RunRecord, classify_load

if TYPE_CHECKING:
    from dsec.control.ports import Clock, DeviceWriter, DirectiveWriter, EventLog, FleetView
    from dsec.control.state import HotState, LiveWorker

log = logging.getLogger(__name__)


def device_of_pool(device: Device | None, pool: Pool, pools: Mapping[str, Pool]) -> bool:
    """May a worker of ``pool`` say it runs on ``device``? Yes for the pool's own devices, for devices no pool
    claims, and for ids the inventory does not know (nothing pool-wide hangs on those); no for another pool's."""
    if device is None or device.id in pool.devices:
        return True
    if device.pool is not None:
        return device.pool == pool.name
    return not any(device.id in p.devices for p in pools.values())


class Scheduler:
    """Placements, device profiles and device health; acts through the ports it is given."""

    def __init__(
        self,
        state: HotState,
        events: EventLog,
        directives: DirectiveWriter,
        devices: DeviceWriter,
        fleet: FleetView,
        clock: Clock,
        config: DeviceHealthConfig | None = None,
    ) -> None:
        self.state = state
        self.events = events
        self.directives = directives
        self.devices = devices
        self.fleet = fleet
        self.clock = clock
        self.config = config or DeviceHealthConfig()
        self.placements: dict[str, Placement] = {}
        self._placing = asyncio.Lock()
        self.profiles = Profiles()
        self.health = DeviceHealthTracker(self.config)

    def load(self, placements: Iterable[PlacementRow] = ()) -> None:
        """Startup: the placements in force (from the store: the devices they hold stay held across a restart), and
        from the ``device`` events: the profiles (run records), when each device entered its health state (its
        probation clocks run from then, not from the restart) and the pools still held back after a degradation; from
        the ``room`` events, the cards still holding room made for a burst (a restart must not hand that room to a new
        worker, nor let the next quota pass ask the card for a second move)."""
        for row in placements:
            try:
                self.placements[row.job] = placement_from_dict(row.placement)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                log.error("placement of job %r unreadable, its devices are not held: %s", row.job, exc)
        for ev in self.events.iter_events(EventType.DEVICE):
            if ev.data.get("kind") == "run" and isinstance(ev.data.get("record"), dict):
                try:
                    self.profiles.observe(RunRecord.from_dict(ev.data["record"]))
                except (KeyError, TypeError, ValueError):
                    log.warning("skipping an unreadable run record in event %s", ev.id)
            elif ev.data.get("kind") == "health" and isinstance(ev.data.get("device"), str):
                self._replay_health(ev)
        now = self.clock()
        for ev in self.events.iter_events(EventType.ROOM, since=now - BURST_HOLD_S):
            card, until = ev.data.get("card"), ev.data.get("until")
            if isinstance(card, str) and isinstance(until, int | float) and until > now:
                self.state.room_until[card] = max(self.state.room_until.get(card, 0.0), float(until))

    def _replay_health(self, ev: Event) -> None:
        """A recorded health change, as ``_set_health`` / ``_degrade`` applied it (events come in id order)."""
        self.health.entered(str(ev.data["device"]), ev.ts)
        if ev.data.get("to") == DeviceHealth.DEGRADED.value and ev.pool:
            # decide.degrade holds the pool from the degradation's time: the event's.
            hold_until = degrade(str(ev.data["device"]), ev.ts, self.config).hold_until
            recovering = self.state.pool_recovering_until
            recovering[ev.pool] = max(recovering.get(ev.pool, 0.0), hold_until)

    # -- placement ------------------------------------------------------------------------------------------
    def inventory(self) -> Inventory:
        return from_cluster(self.state.devices.values())

    async def place(self, job: JobSpec, complete_only: bool = False) -> Placement:
        """Place ``job`` and record it (``complete_only``: only when every worker is placed; else nothing changes)."""
        # One placement at a time: two jobs placed at once would each see the other's devices as free.
        async with self._placing:
            return await self._place(job, complete_only)

    async def _place(self, job: JobSpec, complete_only: bool) -> Placement:
        pool = self.state.pools.get(job.pool) if job.pool else None
        allowed = set(pool.devices) if pool is not None and pool.devices else None
        busy = {a.device for name, p in self.placements.items() if name != job.name for a in p.assignments}
        placement = place(
            job,
            self.inventory(),
            self.profiles,
            allowed=allowed,
            gpu_quota=pool.gpu_quota if pool is not None else None,
            busy=busy,
            held=self._room_held(job),
        )
        if complete_only and not placement.complete:
            return placement
        now = self.clock()
        summary = {
            "job": job.name,
            "complete": placement.complete,
            "score": placement.score,
            "devices": {a.worker: a.device for a in placement.assignments},
            "unplaced": dict(placement.unplaced),
        }
        row = PlacementRow(job=job.name, pool=job.pool, placement=placement.to_dict(), placed_at=now)
        ev = Event(ts=now, type=EventType.PLACEMENT, pool=job.pool, data=summary)
        # Durable (with its event, in one transaction) before it is in force: a restart keeps its devices held.
        await self.events.commit(WriteBatch(placements=[row], events=[ev]))
        self.placements[job.name] = placement
        return placement

    def _room_held(self, job: JobSpec) -> dict[str, str]:
        """The devices of cards holding room made for a burst (``HotState.room_until``, dsec.quota.room), with why:
        no new worker goes there while the burst lasts. A worker of ``job`` pinned to its device keeps it (the learner
        whose burst it is, its card-mates that stay)."""
        now = self.clock()
        held = {card: until for card, until in self.state.room_until.items() if until > now}
        if not held:
            return {}
        pinned = {w.device for g in job.groups for w in g.workers if w.device is not None}
        return {
            d.id: f"card {d.card_id} keeps room for a memory burst for {held[d.card_id] - now:.0f} s more"
            for d in self.state.devices.values()
            if d.card_id in held and d.id not in pinned
        }

    async def release(self, job: str) -> bool:
        async with self._placing:
            if job not in self.placements:
                return False
            ev = Event(ts=self.clock(), type=EventType.PLACEMENT, data={"job": job, "released": True})
            await self.events.commit(WriteBatch(released_placements=[job], events=[ev]))
            del self.placements[job]
            return True

    # -- history ------------------------------------------------------------------------------------------------
    def run_record(self, w: LiveWorker, failed: bool) -> Event | None:
        """A ``device`` event describing how a worker's run on its device went (None without a known device)."""
        device = self.state.devices.get(w.info.device or "")
        if device is None:
            return None
        m = w.metrics
        ceiling = w.directive.fields.memory_ceiling_gb
        oom = failed and bool(ceiling) and m.get("memory_used_gb", 0.0) >= 0.95 * float(ceiling or 0)
        record = RunRecord(
            device=device.id,
            model=device.model,
            load_class=classify_load(m),
            worker_key=f"{w.info.group}/{w.info.role.value}-{w.info.rank}",
            oom=oom,
            failed=failed,
            throttled=False,
            leak_gb_per_h=max(0.0, m.get("memory_growth_gb_per_h", 0.0)),
            sync_jitter_ms=max(0.0, m.get("sync_latency_ms_p99", 0.0) - m.get("sync_latency_ms_p50", 0.0)),
            hours=max(0.0, (self.clock() - w.registered_at) / 3600.0),
        )
        self.profiles.observe(record)
        return Event(
            ts=self.clock(), type=EventType.DEVICE, pool=w.pool, worker_id=w.id,
            data={"kind": "run", "device": device.id, "record": record.to_dict()},
        )  # fmt: skip

    # -- device health ------------------------------------------------------------------------------------------
    async def tick(self, now: float) -> None:
        by_device: dict[str, list[LiveWorker]] = {}
        st = self.state
        # No device known: no worker can count for one (the scan is O(workers), every pass).
        for w in list(st.workers.values()) if st.devices else ():
            device = st.devices.get(w.info.device or "")
            pool = st.pools.get(w.pool)
            # A worker counts for a device only while the device is its pool's (devices move between pools).
            if w.state is WorkerState.ACTIVE and device and pool and device_of_pool(device, pool, st.pools):
                by_device.setdefault(device.id, []).append(w)
        devices = dict(self.state.devices)
        placed = [(d, w.id) for d, ws in by_device.items() for w in ws]
        flags = self.fleet.flags
        # Only the placed workers' flags matter to occupancy: the fleet's others need not be looked at.
        occupied = occupancy(placed, self.fleet.judged, slow_workers({w: flags.get(w, set()) for _, w in placed}))
        for change in self.health.step(now, {d: dev.health for d, dev in devices.items()}, occupied):
            dev = devices[change.device]
            if change.degraded:
                await self._degrade(dev, by_device.get(dev.id, []), now, change.why)
            else:
                await self._set_health(dev, change.after, now, change.why)

    async def _degrade(self, dev: Device, ws: list[LiveWorker], now: float, why: str) -> None:
        flags = {w.id: sorted(self.fleet.flags.get(w.id, set())) for w in ws}
        await self._set_health(dev, DeviceHealth.DEGRADED, now, why, flags=flags)
        verdict = degrade(dev.id, now, self.config)
        if dev.pool:
            self.state.pool_recovering_until[dev.pool] = verdict.hold_until
        for w in ws:
            try:
                await self.directives.set_directive(w, {"snapshot_now": verdict.snapshot_request}, "scheduler")
            except Exception as exc:  # a worker leaving meanwhile must not stop the others' snapshots
                log.warning("could not ask %s for a snapshot: %s", w.id, exc)

    async def _set_health(self, dev: Device, health: DeviceHealth, now: float, why: str, **extra: Any) -> None:
        before = dev.health
        new = replace(dev, health=health)
        data = {"kind": "health", "device": dev.id, "from": before.value, "to": health.value, "why": why, **extra}
        await self.devices.put_device(new, [Event(ts=now, type=EventType.DEVICE, pool=dev.pool, data=data)])
        self.health.entered(dev.id, now)
        log.info("device %s: %s -> %s (%s)", dev.id, before.value, health.value, why)
