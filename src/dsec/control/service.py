"""The control plane's behaviour, independent of HTTP: registration, heartbeats, directives, pools,
liveness. Routes are thin adapters over this class; the simulator and tests can drive it directly.

Durability rule: anything the API acknowledges that is not re-sent by the worker (a registration,
an event, a directive change) is committed through the group-commit writer *before* the answer and
applied to the hot state only after that commit succeeded. Plain metric beats only touch memory.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any

from dsec.alerts import AlertRouter, LogSink, Sink, WebhookSink
from dsec.control import auth, errors, retention
from dsec.control.access import Access
from dsec.control.egress import Egress
from dsec.control.judge import Judge, Verdict
from dsec.control.liveness import Beat, overdue
from dsec.control.policies import PolicyRunner
from dsec.control.ratelimit import RateLimiter
from dsec.control.runtimes import Delivery, DeliveryRetention, RetryPolicy, RuntimeHub
from dsec.control.scheduling import Scheduler, device_of_pool
from dsec.control.schemas import HeartbeatRequest, RegisterRequest
from dsec.control.settings import Settings
from dsec.control.state import HotState, LiveWorker
from dsec.control.store import EventQuery, Store, StoreError, WriteBatch
from dsec.control.writer import GroupCommitWriter
from dsec.model import (
    Device,
    Directive,
    DirectiveFields,
    Event,
    EventType,
    ModelError,
    Pool,
    WorkerInfo,
    WorkerState,
)

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
        self.heartbeats = 0
        self.duplicates = 0
        self.access = Access(self.state, store, clock, settings.admin_token, self._runtime_token)
        # Per-worker event budgets (worker id -> bucket); on the clock the control plane runs on.
        self.event_budget = RateLimiter(settings.worker_events_per_s, settings.worker_events_burst, clock=clock)
        self._last_retention = -math.inf
        self._load()
        self.writer = GroupCommitWriter(
            store, self.state.take_dirty, self.state.mark_dirty, flush_interval_s=settings.flush_interval_s
        )
        sinks: list[Sink] = list(alert_sinks)
        if settings.alert_log:
            sinks.append(LogSink())
        sinks += [WebhookSink(url, secret) for url, secret in settings.alert_webhooks]
        self.alerts = AlertRouter(
            sinks,
            group_wait_s=settings.alert_group_wait_s,
            group_interval_s=settings.alert_group_interval_s,
            repeat_interval_s=settings.alert_repeat_interval_s,
        )
        self.judge = Judge(self.state, settings.judge, self.alerts, settings.forward_worker_alerts)
        self.judge.resume_levels = self._resume_levels
        self.scheduler = Scheduler(self)
        self.scheduler.load()
        retry = settings.webhook_retry or RetryPolicy()
        self.runtimes = RuntimeHub(
            store,
            retry,
            on_outcome=self._webhook_outcome,
            clock=clock,
            egress=Egress(settings.webhook_allow_private, settings.webhook_max_response_bytes, retry.timeout_s),
            retention=DeliveryRetention(settings.webhook_deliveries_kept, settings.webhook_delivery_retention_s),
        )
        self.runtimes.load(legacy_file=settings.home / "runtimes.json")
        self.policies = PolicyRunner(self)
        self.policies.load()

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
        # One pass over the breaker history: meltdown counters, and each worker's level after its last
        # recorded transition (events come in id order) for the breakers to resume at.
        levels: dict[str, int] = {}
        for ev in self._iter_events(EventType.MELTDOWN, EventType.BREAKER, EventType.RECOVERED):
            self._count(ev)
            level = ev.data.get("level_to")
            if ev.worker_id and ev.data.get("kind") == "breaker" and isinstance(level, int):
                levels[ev.worker_id] = level
        self._resume_levels = {w: lvl for w, lvl in levels.items() if lvl > 0}

    def _iter_events(self, *etypes: EventType, since: float | None = None) -> Iterable[Event]:
        after = 0
        while True:
            page = self.store.query_events(EventQuery(types=etypes, since=since, after_id=after, limit=1000))
            yield from page
            if len(page) < 1000:
                return
            after = page[-1].id or after

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
        self.writer.submit(WriteBatch(events=[ev]))

    # -- writes that must be durable first -----------------------------------------------------
    async def _commit(self, batch: WriteBatch) -> list[int]:
        try:
            return await asyncio.wrap_future(self.writer.submit(batch))
        except StoreError as exc:
            raise errors.unavailable(f"state store unavailable, retry later: {exc}") from exc

    async def record_events(self, events: list[Event]) -> list[int]:
        ids = await self._commit(WriteBatch(events=events))
        self._observe_events(events)
        return ids

    def _observe_events(self, events: Iterable[Event]) -> None:
        for ev in events:
            self._count(ev)
            if ev.type is EventType.ALERT:
                self.judge.route(ev)
            elif ev.type is EventType.RESTORE and ev.pool and ev.worker_id:
                # Validated at the edge (schemas.EventIn); aggregated per distinct worker (gauges.pool_recovery_s).
                restore_s = ev.data.get("restore_s")
                if isinstance(restore_s, (int, float)) and not isinstance(restore_s, bool):
                    self.state.restore_reports.setdefault(ev.pool, {})[ev.worker_id] = float(restore_s)

    def _count(self, ev: Event) -> None:
        """Meltdown counters, per pool and per worker: from committed events only (also at startup)."""
        if ev.type is EventType.MELTDOWN:
            if ev.pool:
                self.state.meltdowns[ev.pool] += 1
            if ev.worker_id:
                self.state.worker_meltdowns[ev.worker_id] += 1

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

    def worker_for(self, worker_id: str, token: str | None, read: bool = False) -> LiveWorker:
        """The worker, if ``token`` is its own token or an admin token (with ``read``, a read-only token too)."""
        return self.access.worker_for(worker_id, token, read)

    # -- workers -----------------------------------------------------------------------------
    def _registrant(self, req: RegisterRequest, token: str | None) -> tuple[Pool, str | None]:
        """The pool to register in and the registering pool token's id (None for an admin token), once the token
        may register this worker: its own pool, a device of that pool, within its quota."""
        if token is None:
            raise errors.unauthorized()
        token_pool = self.pool_of_token(token)
        if token_pool is None and not self.is_admin(token):
            raise errors.forbidden("unknown or revoked token")
        if token_pool is not None and token_pool != req.pool:
            raise errors.forbidden(
                f"this token registers workers in pool {token_pool!r} only, not in {req.pool!r}", "pool"
            )
        pool = self.state.pools.get(req.pool)
        if pool is None:
            raise errors.not_found("pool", req.pool, "pool")
        if token_pool is None:
            return pool, None
        if req.device is not None and not device_of_pool(self.state.devices.get(req.device), pool, self.state.pools):
            # Not "it is pool X's": the token holder learns nothing about other pools.
            raise errors.forbidden(f"device {req.device!r} is not a device of pool {req.pool!r}", "device")
        token_id = auth.token_id(auth.hash_token(token))
        if self.state.workers_by_token[token_id] >= self.settings.max_workers_per_token:
            raise errors.ApiError(
                429,
                "quota_exceeded",
                f"this pool token has {self.state.workers_by_token[token_id]} registered workers, the most it may "
                f"have (max_workers_per_token); deregister some first",
                "Authorization",
            )
        return pool, token_id

    async def register(self, req: RegisterRequest, token: str | None) -> dict[str, Any]:
        pool, token_id = self._registrant(req, token)
        now = self.clock()
        worker_id = f"w-{uuid.uuid4().hex[:12]}"
        worker_token = auth.new_token(auth.WORKER_PREFIX)
        info = WorkerInfo(**dict(req))  # the wire schema and the domain type share their field names
        directive = self.state.directive_for_new_worker(worker_id, pool, now)
        w = LiveWorker(
            id=worker_id,
            info=info,
            state=WorkerState.ACTIVE,
            token_hash=auth.hash_token(worker_token),
            registered_at=now,
            last_beat_at=now,
            last_seq=0,
            acked_version=0,
            beats=0,
            metrics={},
            directive=directive,
            token_id=token_id,
        )
        ev = Event(
            ts=now,
            type=EventType.REGISTERED,
            worker_id=worker_id,
            pool=req.pool,
            data={"role": req.role.value, "group": req.group, "rank": req.rank, "host": req.host, "pid": req.pid},
        )
        await self._commit(WriteBatch(workers=[w.row()], directives=[directive], events=[ev]))
        self.state.workers[worker_id] = w
        self.state.worker_token_hashes[w.token_hash] = worker_id
        if token_id is not None:
            self.state.workers_by_token[token_id] += 1
        return {
            "worker_id": worker_id,
            "worker_token": worker_token,
            "heartbeat_interval_s": req.heartbeat_interval_s,
            "lost_after_beats": self.settings.lost_after_beats,
            "directive": directive.to_dict(),
        }

    async def heartbeat(self, w: LiveWorker, req: HeartbeatRequest) -> dict[str, Any]:
        # One beat of a worker at a time: a retry arriving while the original is still being committed
        # must see the original's outcome, not race it (the lock is uncontended in normal operation).
        async with w.lock:
            return await self._heartbeat(w, req)

    async def _heartbeat(self, w: LiveWorker, req: HeartbeatRequest) -> dict[str, Any]:
        now = self.clock()
        if w.state is WorkerState.DEREGISTERED:
            raise errors.conflict(f"worker_id {w.id!r} has deregistered; register again to report", "worker_id")
        if req.seq == w.last_seq:
            # A retry of the beat we already applied (its answer was lost): apply nothing twice.
            self.duplicates += 1
            return self._beat_answer(w, req, now, duplicate=True)
        if req.seq < w.last_seq:
            raise errors.conflict(
                f"seq {req.seq} is older than the last accepted seq {w.last_seq} (replayed or out of order)",
                "seq",
            )
        if req.acked_directive_version > w.directive.version:
            raise errors.ApiError(
                422,
                "invalid",
                f"acked_directive_version {req.acked_directive_version} was never issued "
                f"(latest is {w.directive.version})",
                "acked_directive_version",
            )
        metrics = self._merged_metrics(w, req)
        if req.events:
            self._spend_event_budget(w, len(req.events))
        was_lost = w.state is WorkerState.LOST
        newly_acked = req.acked_directive_version > w.acked_version
        events = self._worker_events(w, req, now)
        if was_lost:
            events.append(
                Event(
                    ts=now,
                    type=EventType.REJOINED,
                    worker_id=w.id,
                    pool=w.pool,
                    data={"silent_s": round(now - w.last_beat_at, 3)},
                )
            )
        if newly_acked and req.acked_directive_version == w.directive.version:
            events.append(
                Event(
                    ts=now,
                    type=EventType.DIRECTIVE_ACKED,
                    worker_id=w.id,
                    pool=w.pool,
                    data={"version": req.acked_directive_version},
                )
            )
        acked = max(w.acked_version, req.acked_directive_version)
        worker_events = events[: len(req.events)]
        verdict, saved = self.judge.on_beat(w, req.metrics, worker_events, acked, now)
        directive = self._directive_from(w, verdict, now)
        if directive is not None:
            events.append(self._directive_event(w, directive, verdict.patch, "+".join(verdict.actors), now))
        events += verdict.events
        if events:
            # Durable before acknowledged: write the beat's row, its events and any directive the
            # judgment made in one transaction.
            row = replace(
                w.row(),
                last_seq=req.seq,
                last_beat_at=now,
                state=WorkerState.ACTIVE.value,
                beats=w.beats + 1,
                acked_version=acked,
                metrics=metrics,
            )
            try:
                await self._commit(
                    WriteBatch(workers=[row], events=events, directives=[directive] if directive else [])
                )
            except BaseException:
                self.judge.restore(w, saved)
                raise
            self._observe_events(events)
            if directive is not None:
                w.directive = directive
                self.judge.issued(w, verdict, directive.version, now)
        w.last_seq = req.seq
        w.last_beat_at = now
        w.beats += 1
        w.metrics = metrics  # swapped, not mutated: the writer thread may be copying the old dict
        if newly_acked:
            w.acked_version = req.acked_directive_version
        if was_lost:
            w.state = WorkerState.ACTIVE
        self.heartbeats += 1
        if not events:
            self.state.mark_dirty(w.id)
        return self._beat_answer(w, req, now, duplicate=False)

    def _merged_metrics(self, w: LiveWorker, req: HeartbeatRequest) -> Mapping[str, float]:
        """The worker's metrics with the beat's merged in; 422 when that would exceed its distinct-name budget (each
        beat is capped, but names accumulate across beats)."""
        cap = self.settings.max_metrics_per_worker
        if len(w.metrics) + len(req.metrics) > cap:
            new = len(req.metrics.keys() - w.metrics.keys())
            if len(w.metrics) + new > cap:
                raise errors.ApiError(
                    422,
                    "invalid",
                    f"metrics: {new} new metric name(s) would give worker_id {w.id!r} {len(w.metrics) + new} distinct "
                    f"names; a worker may hold at most {cap} (max_metrics_per_worker): reuse names",
                    "metrics",
                )
        return w.merged_metrics(req.metrics, self.settings.metric_max_age_beats)  # every beat ages them

    def _spend_event_budget(self, w: LiveWorker, n: int) -> None:
        wait = self.event_budget.take(w.id, n)
        if wait > 0:
            cfg = self.settings
            raise errors.ApiError(
                429,
                "rate_limited",
                f"events: worker_id {w.id!r} sent more events than its budget ({cfg.worker_events_per_s:g}/s, "
                f"burst {cfg.worker_events_burst}); nothing of this beat was applied, send it again later",
                "events",
            )

    def _worker_events(self, w: LiveWorker, req: HeartbeatRequest, now: float) -> list[Event]:
        """The beat's events as recorded: attributed (``source: worker``, whatever the worker wrote there) and dated
        by the worker only when its time is plausible (else by the server, the worker's kept as ``worker_ts``)."""
        cfg = self.settings
        out = []
        for e in req.events:
            ts = retention.event_time(e.ts, now, cfg.event_retention_s, cfg.max_clock_skew_s)
            data = {**e.data, "source": "worker"}
            if e.ts is not None and ts != e.ts:
                data["worker_ts"] = e.ts
            out.append(Event(ts=ts, type=e.type, worker_id=w.id, pool=w.pool, data=data))
        return out

    def _beat_answer(self, w: LiveWorker, req: HeartbeatRequest, now: float, duplicate: bool) -> dict[str, Any]:
        return {
            "seq": req.seq,
            "duplicate": duplicate,
            "server_time": now,
            "directive": w.directive.to_dict() if req.acked_directive_version != w.directive.version else None,
            # The cap the worker's syncs are counted against (dsec_gradient_sync_success_rate).
            "latency_cap_ms": self.judge.caps_for(w).latency_ms,
        }

    def _directive_from(self, w: LiveWorker, verdict: Verdict, now: float) -> Directive | None:
        """The next directive version carrying a judgment's patch; None when it changes nothing."""
        if not verdict.patch:
            return None
        try:
            fields = w.directive.fields.merged(verdict.patch)
        except ModelError:
            log.exception("judgment produced an invalid directive for %s: %s", w.id, verdict.patch)
            return None
        if fields == w.directive.fields and not verdict.breaker_issued:
            return None
        # An unchanged directive still gets a new version when the breaker issued it: the breaker moves
        # on only once the worker acks a version carrying its level.
        return Directive(worker_id=w.id, version=w.directive.version + 1, fields=fields, updated_at=now)

    @staticmethod
    def _directive_event(w: LiveWorker, d: Directive, patch: Mapping[str, Any], actor: str, now: float) -> Event:
        return Event(
            ts=now,
            type=EventType.DIRECTIVE_SET,
            worker_id=w.id,
            pool=w.pool,
            data={"version": d.version, "changes": dict(patch), "by": actor},
        )

    async def deregister(self, w: LiveWorker, reason: str) -> dict[str, Any]:
        async with w.lock:
            return await self._deregister(w, reason)

    async def _deregister(self, w: LiveWorker, reason: str) -> dict[str, Any]:
        if w.state is WorkerState.DEREGISTERED:
            return w.to_api()
        now = self.clock()
        row = replace(w.row(), state=WorkerState.DEREGISTERED.value)
        ev = Event(ts=now, type=EventType.DEREGISTERED, worker_id=w.id, pool=w.pool, data={"reason": reason})
        run = self.scheduler.run_record(w, failed=False)
        await self._commit(WriteBatch(workers=[row], events=[ev] + ([run] if run else [])))
        w.state = WorkerState.DEREGISTERED
        w.ended_at = now
        if w.token_id is not None:
            self.state.workers_by_token[w.token_id] -= 1
        self.judge.forget(w.id)  # a worker that left is judged no more
        return w.to_api()

    async def set_directive(
        self, w: LiveWorker, patch: Mapping[str, Any], actor: str, extra_events: Sequence[Event] = ()
    ) -> Directive:
        # Serialised per worker: two concurrent patches must yield two versions, not one lost update.
        async with w.lock:
            return await self._set_directive(w, patch, actor, extra_events)

    async def _set_directive(
        self, w: LiveWorker, patch: Mapping[str, Any], actor: str, extra_events: Sequence[Event] = ()
    ) -> Directive:
        if w.state is WorkerState.DEREGISTERED:
            raise errors.conflict(f"worker_id {w.id!r} has deregistered; directives no longer apply", "worker_id")
        try:
            fields = w.directive.fields.merged(patch)
        except ModelError as exc:
            raise errors.ApiError(422, "invalid", str(exc), str(exc).split("=", 1)[0].split(" ")[0]) from exc
        now = self.clock()
        new = Directive(worker_id=w.id, version=w.directive.version + 1, fields=fields, updated_at=now)
        ev = self._directive_event(w, new, patch, actor, now)
        await self._commit(WriteBatch(directives=[new], events=[ev, *extra_events]))
        self._observe_events(extra_events)
        w.directive = new
        return new

    # -- pools and devices ---------------------------------------------------------------------
    async def put_pool(self, pool: Pool, actor: str = "api") -> Pool:
        now = self.clock()
        created = pool.name not in self.state.pools
        await asyncio.to_thread(self.store.put_pool, pool, now)
        self.state.pools[pool.name] = pool
        await self.record_events(
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

    async def create_token(self, kind: str, pool: str | None, label: str) -> str:
        return await self.access.create(kind, pool, label)

    async def list_tokens(self) -> list[dict[str, Any]]:
        return await self.access.list()

    async def revoke_token(self, token_id: str) -> None:
        await self.access.revoke(token_id)

    # -- reconcile -----------------------------------------------------------------------------
    async def reconcile(self) -> list[str]:
        """One pass of the control loop: mark overdue workers lost (durably, with an event), then the
        periodic judgments (fleet comparison, elastic quotas, precision restores), then the policies (on their
        own interval)."""
        lost = await self._mark_lost()
        await self._judge_periodic()
        await self.scheduler.tick(self.clock())
        await self.policies.tick()
        await self.retain()
        return lost

    async def retain(self, force: bool = False) -> tuple[list[str], int]:
        """Forget workers that deregistered ``worker_retention_s`` ago and prune events older than
        ``event_retention_s`` (control/retention.py); at most every ``retention_interval_s``. Returns the evicted
        worker ids and how many events were pruned."""
        now = self.clock()
        if not force and now - self._last_retention < self.settings.retention_interval_s:
            return [], 0
        self._last_retention = now
        gone = retention.evictable(self.state.workers.values(), now, self.settings.worker_retention_s)
        if gone:
            await self._commit(WriteBatch(deleted_workers=gone))
            for wid in gone:
                w = self.state.workers.pop(wid)
                self.state.worker_token_hashes.pop(w.token_hash, None)
                self.state.restore_reports.get(w.pool, {}).pop(wid, None)
                self.state.worker_meltdowns.pop(wid, None)
                self.event_budget.forget(wid)
                self.judge.forget(wid)
        pruned = 0
        cutoff = retention.event_cutoff(now, self.settings.event_retention_s)
        if cutoff is not None:
            pruned = await asyncio.to_thread(self.store.prune_events, cutoff, retention.KEPT_TYPES)
        if gone or pruned:
            log.info("retention: forgot %d deregistered worker(s), pruned %d event(s)", len(gone), pruned)
        return gone, pruned

    async def _judge_periodic(self) -> None:
        now = self.clock()
        changes, events = self.judge.periodic(now)
        if events:
            await self.record_events(events)
        for c in changes:
            w = self.state.workers.get(c.worker_id)
            if w is None or w.state is WorkerState.DEREGISTERED:
                continue
            try:
                await self.set_directive(w, c.patch, c.actor, c.events)
            except errors.ApiError as exc:
                log.warning("%s could not change %s's directive: %s", c.actor, c.worker_id, exc)

    async def _mark_lost(self) -> list[str]:
        now = self.clock()
        beats = [Beat(w.id, w.state, w.last_beat_at, w.info.heartbeat_interval_s) for w in self.state.workers.values()]
        lost = overdue(beats, now, self.settings.lost_after_beats)
        if not lost:
            return []
        events, rows = [], []
        for wid in lost:
            w = self.state.workers[wid]
            events.append(
                Event(
                    ts=now,
                    type=EventType.LOST,
                    worker_id=wid,
                    pool=w.pool,
                    data={"silent_s": round(now - w.last_beat_at, 3), "missed_beats": self.settings.lost_after_beats},
                )
            )
            rows.append(replace(w.row(), state=WorkerState.LOST.value))
            run = self.scheduler.run_record(w, failed=True)
            if run is not None:
                events.append(run)
        await self._commit(WriteBatch(workers=rows, events=events))
        for wid in lost:
            w = self.state.workers[wid]
            if w.last_beat_at <= now:  # it did not come back while we were committing
                w.state = WorkerState.LOST
        log.info("workers lost: %s", ", ".join(lost))
        return lost

    # -- read side -----------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        pools = []
        for p in sorted(self.state.pools.values(), key=lambda p: p.name):
            ws = [w for w in self.state.workers.values() if w.pool == p.name]
            pools.append(
                {
                    **p.to_dict(),
                    "workers": {s.value: sum(1 for w in ws if w.state is s) for s in WorkerState},
                    "directives_pending": sum(
                        1 for w in ws if w.state is WorkerState.ACTIVE and w.acked_version != w.directive.version
                    ),
                    "meltdowns": self.state.meltdowns.get(p.name, 0),
                    "memory": mem.to_dict() if (mem := self.judge.pool_memory.get(p.name)) else None,
                    "sync_slowdown": p.name in self.judge.slow_pools,
                }
            )
        return {
            "server_time": self.clock(),
            "uptime_s": self.clock() - self.started_at,
            "heartbeats": self.heartbeats,
            "pools": pools,
            "workers": [
                self.worker_api(w)
                for w in sorted(self.state.workers.values(), key=lambda w: (w.pool, w.info.group, w.info.rank, w.id))
            ],
        }

    def directive_api(self, w: LiveWorker) -> dict[str, Any]:
        """Desired vs acked directive, with the breaker caps in force for the worker (its own overrides, else its
        pool's thresholds, which policies may change)."""
        return {**w.to_api()["directive"], "caps": self.judge.caps_for(w).limits()}

    def worker_api(self, w: LiveWorker) -> dict[str, Any]:
        """A worker as the API shows it: its row, directive, and what the judgment thinks of it."""
        return {
            **w.to_api(),
            "breaker": self.judge.breaker_state(w, self.clock()),
            "meltdowns": self.state.worker_meltdowns.get(w.id, 0),
            "fleet_outlier": sorted(self.judge.flags.get(w.id, ())),
            "caps": self.judge.caps_for(w).limits(),
        }
