"""The control plane's behaviour, independent of HTTP: registration, heartbeats, directives, pools,
liveness. Routes are thin adapters over this class; the simulator and tests can drive it directly.

Durability rule: anything the API acknowledges that is not re-sent by the worker (a registration,
an event, a directive change) is committed through the group-commit writer *before* the answer and
applied to the hot state only after that commit succeeded. Plain metric beats only touch memory.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, replace
from typing import Any

from dsec.alerts import AlertRouter, LogSink, Sink, WebhookSink
from dsec.control import auth, errors
from dsec.control.judge import Judge, Verdict
from dsec.control.liveness import Beat, overdue
from dsec.control.policies import PolicyRunner
from dsec.control.runtimes import Delivery, RuntimeHub
from dsec.control.scheduling import Scheduler
from dsec.control.schemas import HeartbeatRequest, RegisterRequest
from dsec.control.settings import Settings
from dsec.control.state import HotState, LiveWorker
from dsec.control.store import EventQuery, Store, StoreError, TokenRow, WriteBatch
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
        self.judge = Judge(self.state, settings.judge, self.alerts)
        self.judge.resume_levels = self._resume_levels
        self.scheduler = Scheduler(self)
        self.scheduler.load()
        self.runtimes = RuntimeHub(
            settings.home / "runtimes.json", settings.webhook_retry, on_outcome=self._webhook_outcome, clock=clock
        )
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
        for tok in self.store.list_tokens():
            if tok.kind == "admin":
                st.admin_token_hashes.add(tok.token_hash)
            elif tok.pool:
                st.pool_token_hashes[tok.token_hash] = tok.pool
        if self.settings.admin_token:
            st.admin_token_hashes.add(auth.hash_token(self.settings.admin_token))
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
            elif ev.type is EventType.RESTORE and ev.pool:
                restore_s = ev.data.get("restore_s")
                if isinstance(restore_s, (int, float)):
                    self.state.last_recovery_s[ev.pool] = float(restore_s)

    def _count(self, ev: Event) -> None:
        """Meltdown counters, per pool and per worker: from committed events only (also at startup)."""
        if ev.type is EventType.MELTDOWN:
            if ev.pool:
                self.state.meltdowns[ev.pool] += 1
            if ev.worker_id:
                self.state.worker_meltdowns[ev.worker_id] += 1

    # -- auth --------------------------------------------------------------------------------
    def is_admin(self, token: str | None) -> bool:
        return token is not None and auth.hash_token(token) in self.state.admin_token_hashes

    def require_admin(self, token: str | None) -> None:
        if token is None:
            raise errors.unauthorized()
        if not self.is_admin(token):
            raise errors.forbidden("this route needs an admin token")

    def pool_of_token(self, token: str | None) -> str | None:
        return None if token is None else self.state.pool_token_hashes.get(auth.hash_token(token))

    def worker_for(self, worker_id: str, token: str | None) -> LiveWorker:
        """The worker, if ``token`` is its own token (or an admin token)."""
        if token is None:
            raise errors.unauthorized()
        w = self.state.workers.get(worker_id)
        if w is None:
            raise errors.not_found("worker", worker_id, "worker_id")
        h = auth.hash_token(token)
        if auth.same_hash(h, w.token_hash) or h in self.state.admin_token_hashes:
            return w
        owner = self.state.workers.get(self.state.worker_token_hashes.get(h, ""))
        if owner is not None:
            raise errors.forbidden(
                f"this token belongs to worker {owner.id!r} (pool {owner.pool!r}); a worker reports only as "
                f"itself, not as worker_id {worker_id!r} (pool {w.pool!r})",
                "worker_id",
            )
        if h in self.state.pool_token_hashes:
            raise errors.forbidden("a pool token registers workers; heartbeats need the worker's own token")
        raise errors.forbidden("unknown token")

    # -- workers -----------------------------------------------------------------------------
    async def register(self, req: RegisterRequest, token: str | None) -> dict[str, Any]:
        if token is None:
            raise errors.unauthorized()
        token_pool = self.pool_of_token(token)
        if token_pool is None and not self.is_admin(token):
            raise errors.forbidden("unknown token")
        if token_pool is not None and token_pool != req.pool:
            raise errors.forbidden(f"this token belongs to pool {token_pool!r}, not pool {req.pool!r}", "pool")
        pool = self.state.pools.get(req.pool)
        if pool is None:
            raise errors.not_found("pool", req.pool, "pool")
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
        was_lost = w.state is WorkerState.LOST
        metrics = {**w.metrics, **req.metrics} if req.metrics else w.metrics
        newly_acked = req.acked_directive_version > w.acked_version
        events = [
            Event(ts=e.ts if e.ts is not None else now, type=e.type, worker_id=w.id, pool=w.pool, data=e.data)
            for e in req.events
        ]
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
        await asyncio.to_thread(self.store.delete_pool, name)
        del self.state.pools[name]

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
        if kind == "pool" and pool not in self.state.pools:
            raise errors.not_found("pool", str(pool), "pool")
        token = auth.new_token(auth.ADMIN_PREFIX if kind == "admin" else auth.POOL_PREFIX)
        row = TokenRow(auth.hash_token(token), pool, kind, label, self.clock())
        await asyncio.to_thread(self.store.put_token, row)
        if kind == "admin":
            self.state.admin_token_hashes.add(row.token_hash)
        else:
            self.state.pool_token_hashes[row.token_hash] = str(pool)
        return token

    # -- reconcile -----------------------------------------------------------------------------
    async def reconcile(self) -> list[str]:
        """One pass of the control loop: mark overdue workers lost (durably, with an event), then the
        periodic judgments (fleet comparison, elastic quotas, precision restores), then the policies (on their
        own interval)."""
        lost = await self._mark_lost()
        await self._judge_periodic()
        await self.scheduler.tick(self.clock())
        await self.policies.tick()
        return lost

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
