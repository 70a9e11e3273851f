"""The control plane's composition root: builds its parts, loads the startup state, and exposes the operations
the HTTP routes (``*_routes.py``, wired by ``app.py``) and tests call. Routes are thin adapters over this class.

Parts (each in its own module, each given only what it uses — see ``ports.py``):

- ``eventlog.DurableLog`` — durable writes through the group-commit writer, the event history;
- ``beats.Beats`` — registration, heartbeats, deregistration (the hot path);
- ``directives.Directives`` — directive versions;
- ``pools.PoolsAndDevices`` — the inventory;
- ``judge.Judge`` — per-worker decision state over the pure decision core ``dsec.decide``;
- ``scheduling.Scheduler``, ``policies.PolicyRunner``, ``runtimes.RuntimeHub`` — placement and device health,
  policy rules, runtime webhooks;
- ``reconcile.Reconciler`` — the periodic pass; ``read_models.ReadModels`` — what the API shows;
- ``cost.CostMeter`` — cost accounting over the recorded events (``dsec.cost``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict
from typing import Any

from dsec.alerts import AlertRouter, LogSink, Sink, WebhookSink
from dsec.control.access import Access
from dsec.control.beats import Beats
from dsec.control.cost import CostMeter
from dsec.control.directives import Directives
from dsec.control.egress import Egress
from dsec.control.eventlog import DurableLog
from dsec.control.gauges import Gauges
from dsec.control.judge import Judge
from dsec.control.policies import PolicyRunner, import_policy_file
from dsec.control.pools import PoolsAndDevices
from dsec.control.read_models import ReadModels
from dsec.control.reconcile import Reconciler
from dsec.control.runtimes import Delivery, DeliveryRetention, RetryPolicy, RuntimeHub
from dsec.control.scheduling import Scheduler
from dsec.control.schemas import Beat, RegisterRequest
from dsec.control.settings import Settings
from dsec.control.state import HotState, LiveWorker
from dsec.control.store import Store, WriteBatch
from dsec.control.writer import GroupCommitWriter
from dsec.model import Device, Directive, DirectiveFields, Event, EventType, Pool, WorkerState

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class ControlPlane:
    """Owns the hot state, the store and the writer. ``close()`` flushes and stops the writer."""

    def __init__(
        self, settings: Settings, store: Store, clock: Clock = time.time, alert_sinks: Iterable[Sink] = ()
    ) -> None:
        self.settings = settings
        self.store = store
        self.clock = clock
        self.state = HotState()
        self.started_at = clock()
        self.log = DurableLog(self.state, store)
        self.access = Access(self.state, store, clock, settings.admin_token, self._runtime_token)
        self._load()
        self.writer = GroupCommitWriter(
            store, self.state.take_dirty, self.state.mark_dirty, flush_interval_s=settings.flush_interval_s
        )
        self.alerts = self._alert_router(settings, alert_sinks)
        self.judge = Judge(self.state, settings.judge, self.alerts, settings.forward_worker_alerts)
        self.judge.resume_levels = self._resume_levels
        self.log.bind(self.writer, self.judge.route)
        self.directives = Directives(self.log, clock)
        self.inventory = PoolsAndDevices(self.state, store, self.log, self.access, clock)
        self.gauges = Gauges(
            self.state,
            self.judge.pool_memory,
            self.judge.breakers,
            settings.restore_min_reporters,
            caps_for=self.judge.caps_for,
        )
        self.scheduler = Scheduler(
            self.state, self.log, self.directives, self.inventory, self.judge, clock, settings.device_health
        )
        self.scheduler.load(store.list_placements())
        self.beats = Beats(self.state, settings, self.log, self.judge, self.access, self.scheduler.run_record, clock)
        self.runtimes = self._runtime_hub(settings, store, clock)
        self.policies = PolicyRunner(
            self.state, settings, self.log, self.gauges, self.directives, self.inventory, clock
        )
        import_policy_file(store, settings.home / "policies.yaml", clock)
        self.policies.load(store.current_policy())
        self.reconciler = Reconciler(
            self.state, settings, store, self.log, self.directives, self.judge, self.beats, self.scheduler,
            self.policies, clock,
        )  # fmt: skip
        self.reads = ReadModels(self.state, self.judge, self.beats, clock, self.started_at)
        self.cost = CostMeter(self.state, store, settings, clock, self.started_at)
        self.reconciler.on_pruned = self.cost.forget_pruned

    @staticmethod
    def _alert_router(settings: Settings, extra: Iterable[Sink]) -> AlertRouter:
        sinks: list[Sink] = list(extra)
        if settings.alert_log:
            sinks.append(LogSink())
        sinks += [WebhookSink(url, secret) for url, secret in settings.alert_webhooks]
        return AlertRouter(
            sinks,
            group_wait_s=settings.alert_group_wait_s,
            group_interval_s=settings.alert_group_interval_s,
            repeat_interval_s=settings.alert_repeat_interval_s,
        )

    def _runtime_hub(self, settings: Settings, store: Store, clock: Clock) -> RuntimeHub:
        retry = settings.webhook_retry or RetryPolicy()
        hub = RuntimeHub(
            store,
            retry,
            on_outcome=self._webhook_outcome,
            clock=clock,
            egress=Egress(settings.webhook_allow_private, settings.webhook_max_response_bytes, retry.timeout_s),
            retention=DeliveryRetention(settings.webhook_deliveries_kept, settings.webhook_delivery_retention_s),
        )
        hub.load(legacy_file=settings.home / "runtimes.json")
        return hub

    # -- startup -----------------------------------------------------------------------------
    def _load(self) -> None:
        st = self.state
        st.pools = {p.name: p for p in self.store.list_pools()}
        st.devices = {d.id: d for d in self.store.list_devices()}
        directives = {d.worker_id: d for d in self.store.list_directives()}
        now = self.clock()
        for row in self.store.list_workers():
            d = directives.get(row.id) or Directive(row.id, 1, DirectiveFields(), now)
            w = LiveWorker.from_row(row, d)
            # A restart is not the workers' fault: give every active worker a fresh lost window.
            if w.state is WorkerState.ACTIVE:
                w.last_beat_at = max(w.last_beat_at, now)
            st.workers[w.id] = w
            st.worker_token_hashes[w.token_hash] = w.id
            if w.token_id is not None and w.state is not WorkerState.DEREGISTERED:
                st.workers_by_token[w.token_id] += 1
        self.access.load()
        # One pass over the breaker history: meltdown counters, each worker's level after its last recorded
        # transition (events come in id order) for the breakers to resume at, and the restore times of the
        # workers still held (the pools' recovery gauge).
        levels: dict[str, int] = {}
        for ev in self.log.iter_events(EventType.MELTDOWN, EventType.BREAKER, EventType.RECOVERED, EventType.RESTORE):
            self.log.count(ev)
            if ev.worker_id in st.workers:
                self.log.note_restore(ev)
            level = ev.data.get("level_to")
            if ev.worker_id and ev.data.get("kind") == "breaker" and isinstance(level, int):
                levels[ev.worker_id] = level
        self._resume_levels = {w: lvl for w, lvl in levels.items() if lvl > 0}

    def iter_events(self, *etypes: EventType, since: float | None = None) -> Iterable[Event]:
        return self.log.iter_events(*etypes, since=since)

    def writer_alive(self) -> bool:
        return self.writer.alive()

    def close(self) -> None:
        self.runtimes.close()
        self.writer.close()
        self.alerts.close()

    def _webhook_outcome(self, d: Delivery) -> None:
        """From the delivery thread: the outcome of a policy push, as an event (written, not awaited)."""
        rt = self.runtimes.runtimes.get(d.runtime_id)
        data = {"runtime": d.runtime_id, "delivery": d.id, "status": d.status, "policy": d.payload.get("policy"),
                "attempts": len(d.attempts), "last": asdict(d.attempts[-1]) if d.attempts else None}  # fmt: skip
        ev = Event(ts=self.clock(), type=EventType.WEBHOOK, pool=rt.pool if rt else None, data=data)
        self.log.submit(WriteBatch(events=[ev]))

    # -- the parts' operations, as routes and tests call them ----------------------------------
    @property
    def heartbeats(self) -> int:
        return self.beats.heartbeats

    @property
    def duplicates(self) -> int:
        return self.beats.duplicates

    @property
    def event_budget(self) -> Any:
        return self.beats.event_budget

    async def record_events(self, events: list[Event]) -> list[int]:
        return await self.log.record_events(events)

    async def register(self, req: RegisterRequest, token: str | None) -> dict[str, Any]:
        return await self.beats.register(req, token)

    async def heartbeat(self, w: LiveWorker, req: Beat) -> dict[str, Any]:
        return await self.beats.heartbeat(w, req)

    async def deregister(self, w: LiveWorker, reason: str) -> dict[str, Any]:
        return await self.beats.deregister(w, reason)

    async def set_directive(
        self, w: LiveWorker, patch: Mapping[str, Any], actor: str, extra_events: Sequence[Event] = ()
    ) -> Directive:
        return await self.directives.set_directive(w, patch, actor, extra_events)

    async def put_pool(self, pool: Pool, actor: str = "api", events: Sequence[Event] = ()) -> Pool:
        return await self.inventory.put_pool(pool, actor, events)

    async def delete_pool(self, name: str) -> None:
        await self.inventory.delete_pool(name)

    def apply_cluster(self, pools: Iterable[Pool], devices: Iterable[Device]) -> None:
        self.inventory.apply_cluster(pools, devices)

    async def put_device(self, device: Device) -> Device:
        return await self.inventory.put_device(device)

    async def reconcile(self, stall_s: float = 0.0) -> list[str]:
        return await self.reconciler.reconcile(stall_s)

    async def retain(self, force: bool = False) -> tuple[list[str], int]:
        return await self.reconciler.retain(force)

    def status(self) -> dict[str, Any]:
        return self.reads.status()

    def directive_api(self, w: LiveWorker) -> dict[str, Any]:
        return self.reads.directive_api(w)

    def worker_api(self, w: LiveWorker) -> dict[str, Any]:
        return self.reads.worker_api(w)

    # -- auth (control/access.py) --------------------------------------------------------------
    def _runtime_token(self, token_hash: str) -> bool:
        runtimes = getattr(self, "runtimes", None)  # not yet built while the state loads
        return runtimes is not None and runtimes.has_token(token_hash)

    def is_admin(self, token: str | None) -> bool:
        return self.access.is_admin(token)

    def require_admin(self, token: str | None) -> None:
        self.access.require_admin(token)

    def require_read(self, token: str | None) -> None:
        self.access.require_read(token)

    def pool_of_token(self, token: str | None) -> str | None:
        return self.access.pool_of_token(token)

    def batch_sender(self, token: str | None) -> None:
        """Raises unless ``token`` may send a batch of heartbeats (whose items carry their own tokens)."""
        self.access.batch_sender(token)

    def commits_together(self) -> AbstractContextManager[None]:
        """Durable writes this thread submits inside the block are written in one transaction
        (``GroupCommitWriter.grouped``): a batch of heartbeats' beats that carry events."""
        return self.writer.grouped()

    def worker_for(self, worker_id: str, token: str | None, read: bool = False) -> LiveWorker:
        """The worker, if ``token`` is its own token or an admin token (with ``read``, a read-only token too)."""
        return self.access.worker_for(worker_id, token, read)

    async def create_token(self, kind: str, pool: str | None, label: str) -> str:
        return await self.access.create(kind, pool, label)

    async def list_tokens(self) -> list[dict[str, Any]]:
        return await self.access.list()

    async def revoke_token(self, token_id: str) -> None:
        await self.access.revoke(token_id)
