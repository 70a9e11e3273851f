"""Workers' lifecycle on the control plane: registration, heartbeats (the hot path) and deregistration.

A heartbeat is validated (sequence, acked version, metric and event budgets), judged by the decision core through
the judge (``dsec.decide.judge_beat``), and — when it carries events or the judgment changed the directive —
committed in one transaction before it is answered; the answer carries the new directive.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from dsec.control import auth, errors, retention
from dsec.control.access import Access
from dsec.control.directives import directive_event, directive_from
from dsec.control.eventlog import DurableLog
from dsec.control.judge import Judge
from dsec.control.ports import Clock
from dsec.control.ratelimit import RateLimiter
from dsec.control.scheduling import device_of_pool
from dsec.control.schemas import Beat, RegisterRequest
from dsec.control.settings import Settings
from dsec.control.state import HotState, LiveWorker
from dsec.control.store import WriteBatch
from dsec.model import DirectiveFields, Event, EventType, Pool, WorkerInfo, WorkerState

_UNGUARDED = contextlib.nullcontext()  # a plain beat writes no row of its own (reusable: nullcontext holds nothing)


class Beats:
    def __init__(
        self,
        state: HotState,
        settings: Settings,
        log: DurableLog,
        judge: Judge,
        access: Access,
        run_record: Callable[[LiveWorker, bool], Event | None],
        clock: Clock,
    ) -> None:
        self.state = state
        self.settings = settings
        self.log = log
        self.judge = judge
        self.access = access
        self.run_record = run_record
        self.clock = clock
        # Per-worker event budgets (worker id -> bucket); on the clock the control plane runs on.
        self.event_budget = RateLimiter(settings.worker_events_per_s, settings.worker_events_burst, clock=clock)
        self.heartbeats = 0
        self.duplicates = 0

    def _registrant(self, req: RegisterRequest, token: str | None) -> tuple[Pool, str | None]:
        """The pool to register in and the registering pool token's id (None for an admin token), once the token
        may register this worker: its own pool, a device of that pool, within its quota."""
        if token is None:
            raise errors.unauthorized()
        token_pool = self.access.pool_of_token(token)
        if token_pool is None and not self.access.is_admin(token):
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
        await self.log.commit(WriteBatch(workers=[w.row()], directives=[directive], events=[ev]))
        self.state.workers[worker_id] = w
        self.state.may_lose_at(now + self.settings.lost_after_beats * req.heartbeat_interval_s)
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

    async def heartbeat(self, w: LiveWorker, req: Beat) -> dict[str, Any]:
        # One beat of a worker at a time: a retry arriving while the original is still being committed
        # must see the original's outcome, not race it (the lock is uncontended in normal operation).
        # What ``async with w.lock`` does (asyncio.Lock's __aenter__ awaits acquire(), its __aexit__ calls release()),
        # without the two coroutines those add to every beat.
        lock = w.lock
        await lock.acquire()
        try:
            return await self._heartbeat(w, req)
        finally:
            lock.release()

    async def _heartbeat(self, w: LiveWorker, req: Beat) -> dict[str, Any]:
        now = self.clock()
        if self._is_retry(w, req):
            # A retry of the beat we already applied (its answer was lost): apply nothing twice.
            self.duplicates += 1
            return self._beat_answer(w, req, now, duplicate=True)
        metrics = self._merged_metrics(w, req)
        if req.events:
            self._spend_event_budget(w, len(req.events))
        was_lost = w.state is WorkerState.LOST
        newly_acked = req.acked_directive_version > w.acked_version
        # The common beat (no events, not back from lost, nothing newly acked, no inferred role) records nothing of
        # its own: the two calls below would answer [] and None, so it does not make them.
        events = self._beat_events(w, req, now, was_lost, newly_acked) if req.events or was_lost or newly_acked else []
        info_before = w.info
        # Judged in its new role; undone if the commit fails.
        role_event = self._role_change(w, req, now) if req.inferred_role is not None else None
        acked = max(w.acked_version, req.acked_directive_version)
        try:
            verdict, saved = self.judge.on_beat(w, req.metrics, events[: len(req.events)], acked, now)
        except BaseException:
            w.info = info_before
            raise
        if role_event is not None:
            events.append(role_event)
        directive = directive_from(w, verdict, now) if verdict.patch else None  # no patch: no new directive
        if directive is not None:
            events.append(directive_event(w, directive, verdict.patch, "+".join(verdict.actors), now))
        events += verdict.events
        # A beat with events commits the worker's row: the writer takes no dirty copy of it until it is applied here.
        with self.state.writing(w.id) if events else _UNGUARDED:
            if events:
                # Durable before acknowledged: write the beat's row, its events and any directive the
                # judgment made in one transaction.
                row = replace(w.row(), last_seq=req.seq, last_beat_at=now, state=WorkerState.ACTIVE.value,
                              beats=w.beats + 1, acked_version=acked, metrics=metrics)  # fmt: skip
                try:
                    await self.log.commit(
                        WriteBatch(workers=[row], events=events, directives=[directive] if directive else [])
                    )
                except BaseException:
                    self.judge.restore(w, saved)
                    w.info = info_before
                    raise
                self.log.observe(events)
                if directive is not None:
                    w.directive = directive
                    self.judge.issued(w, verdict, directive.version, now)
            w.last_seq = req.seq
            w.last_beat_at = now
            w.beats += 1
            w.metrics = metrics  # swapped, not mutated: the writer thread may be copying the old one
            for ev in req.events:
                if ev.type is EventType.DIRECTIVE_UNAPPLIABLE:
                    _note_unappliable(w, ev.data)
            if newly_acked:
                w.acked_version = req.acked_directive_version
            if was_lost:
                w.state = WorkerState.ACTIVE
                self.state.may_lose_at(now + self.settings.lost_after_beats * w.interval_s)
        self.heartbeats += 1
        if not events:
            self.state.mark_dirty_one(w.id)
        return self._beat_answer(w, req, now, duplicate=False)

    @staticmethod
    def _role_change(w: LiveWorker, req: Beat, now: float) -> Event | None:
        """The role the probe inferred, when it differs from the record: the record takes it (``w.info``), and the
        event that says so (attributed to the worker: the evidence is its own count)."""
        inferred = req.inferred_role
        if inferred is None or inferred.role is w.info.role:
            return None
        data = {"from": w.info.role.value, "to": inferred.role.value, "evidence": inferred.evidence, "source": "worker"}
        w.info = replace(w.info, role=inferred.role)
        return Event(ts=now, type=EventType.ROLE_INFERRED, worker_id=w.id, pool=w.pool, data=data)

    @staticmethod
    def _is_retry(w: LiveWorker, req: Beat) -> bool:
        """True for a retry of the last applied beat; raises for a beat that must not be applied."""
        if w.state is WorkerState.DEREGISTERED:
            raise errors.conflict(f"worker_id {w.id!r} has deregistered; register again to report", "worker_id")
        if req.seq == w.last_seq:
            return True
        if req.seq < w.last_seq:
            raise errors.conflict(
                f"seq {req.seq} is older than the last accepted seq {w.last_seq} (replayed or out of order)", "seq"
            )
        if req.acked_directive_version > w.directive.version:
            raise errors.ApiError(
                422,
                "invalid",
                f"acked_directive_version {req.acked_directive_version} was never issued "
                f"(latest is {w.directive.version})",
                "acked_directive_version",
            )
        return False

    def _beat_events(self, w: LiveWorker, req: Beat, now: float, was_lost: bool, newly_acked: bool) -> list[Event]:
        """The worker's events as recorded, then what the beat itself says: it came back, it acked the latest."""
        events = self._worker_events(w, req, now)
        if was_lost:
            data: dict[str, Any] = {"silent_s": round(now - w.last_beat_at, 3)}
            events.append(Event(ts=now, type=EventType.REJOINED, worker_id=w.id, pool=w.pool, data=data))
        if newly_acked and req.acked_directive_version == w.directive.version:
            data = {"version": req.acked_directive_version}
            events.append(Event(ts=now, type=EventType.DIRECTIVE_ACKED, worker_id=w.id, pool=w.pool, data=data))
        return events

    def _merged_metrics(self, w: LiveWorker, req: Beat) -> Mapping[str, float]:
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

    def _worker_events(self, w: LiveWorker, req: Beat, now: float) -> list[Event]:
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

    def _beat_answer(self, w: LiveWorker, req: Beat, now: float, duplicate: bool) -> dict[str, Any]:
        return {
            "seq": req.seq,
            "duplicate": duplicate,
            "server_time": now,
            "directive": w.directive.to_dict() if req.acked_directive_version != w.directive.version else None,
            # The cap the worker's syncs are counted against (dsec_gradient_sync_success_rate).
            "latency_cap_ms": self.judge.caps_for(w).latency_ms,
        }

    async def deregister(self, w: LiveWorker, reason: str) -> dict[str, Any]:
        async with w.lock:
            return await self._deregister(w, reason)

    async def _deregister(self, w: LiveWorker, reason: str) -> dict[str, Any]:
        if w.state is WorkerState.DEREGISTERED:
            return w.to_api()
        now = self.clock()
        row = replace(w.row(), state=WorkerState.DEREGISTERED.value)
        ev = Event(ts=now, type=EventType.DEREGISTERED, worker_id=w.id, pool=w.pool, data={"reason": reason})
        run = self.run_record(w, False)
        with self.state.writing(w.id):  # no dirty copy (still active) between the commit and the apply
            await self.log.commit(WriteBatch(workers=[row], events=[ev] + ([run] if run else [])))
            w.state = WorkerState.DEREGISTERED
            w.ended_at = now
        if w.token_id is not None:
            self.state.workers_by_token[w.token_id] -= 1
        self.judge.forget(w.id)  # a worker that left is judged no more
        return w.to_api()


def _note_unappliable(w: LiveWorker, data: Mapping[str, Any]) -> None:
    """Remember which field of which directive version the worker cannot carry out (shown by the worker view)."""
    name = data.get("field")
    version = data.get("version")
    if name not in DirectiveFields.__dataclass_fields__ or not isinstance(version, int):
        return
    requested = data.get("requested")
    w.unappliable[str(name)] = {
        "version": version,
        "requested": requested if isinstance(requested, (int, float, str, bool)) else None,
        "reason": str(data.get("reason", ""))[:200],
    }
