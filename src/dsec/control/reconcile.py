"""The control loop's periodic pass: lost workers, periodic judgments, device health, policies, retention."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import replace

from dsec.control import errors, retention
from dsec.control.beats import Beats
from dsec.control.cpu_thread import run_cpu_bound
from dsec.control.directives import Directives
from dsec.control.eventlog import DurableLog
from dsec.control.judge import Judge
from dsec.control.liveness import overdue, scan
from dsec.control.policies import PolicyRunner
from dsec.control.ports import Clock
from dsec.control.scheduling import Scheduler
from dsec.control.settings import Settings
from dsec.control.state import HotState
from dsec.control.store import Store, WriteBatch
from dsec.model import Event, EventType, WorkerState

logger = logging.getLogger(__name__)


#: A scan is skipped only while the pass's time is this much before ``HotState.quiet_until`` (float rounding of the
#: deadline sums, at unix-time magnitudes ~1e-7 s, never decides a skip).
QUIET_MARGIN_S = 1e-3

#: From this many active workers on, a pass's fleet and quota judgments run off the event loop (``_judge_periodic``).
OFF_LOOP_WORKERS = 1000


class Reconciler:
    def __init__(
        self,
        state: HotState,
        settings: Settings,
        store: Store,
        log: DurableLog,
        directives: Directives,
        judge: Judge,
        beats: Beats,
        scheduler: Scheduler,
        policies: PolicyRunner,
        clock: Clock,
    ) -> None:
        self.state = state
        self.settings = settings
        self.store = store
        self.log = log
        self.directives = directives
        self.judge = judge
        self.beats = beats
        self.scheduler = scheduler
        self.policies = policies
        self.clock = clock
        self._last_retention = -math.inf
        self._last_scan_at = -math.inf  # the time the last liveness scan judged silence at
        # Told what each retention pass deleted (the cost gauges' ledger drops the same: control/cost.py).
        self.on_pruned: Callable[[float, Sequence[EventType]], None] | None = None

    async def reconcile(self, stall_s: float = 0.0) -> list[str]:
        """One pass of the control loop: mark overdue workers lost (durably, with an event), then the
        periodic judgments (fleet comparison, elastic quotas, precision restores), then the policies (on their
        own interval). ``stall_s``: how late this pass started (``_mark_lost``)."""
        lost = await self._mark_lost(stall_s)
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
            await self.log.commit(WriteBatch(deleted_workers=gone))
            for wid in gone:
                w = self.state.workers.pop(wid)
                self.state.worker_token_hashes.pop(w.token_hash, None)
                self.state.restore_reports.get(w.pool, {}).pop(wid, None)
                self.state.worker_meltdowns.pop(wid, None)
                self.beats.event_budget.forget(wid)
                self.judge.forget(wid)
        pruned = 0
        cutoff = retention.event_cutoff(now, self.settings.event_retention_s)
        if cutoff is not None:
            pruned = await self.log.prune_events(cutoff, retention.KEPT_TYPES)
            if pruned and self.on_pruned is not None:
                self.on_pruned(cutoff, retention.KEPT_TYPES)
        if gone or pruned:
            logger.info("retention: forgot %d deregistered worker(s), pruned %d event(s)", len(gone), pruned)
        return gone, pruned

    async def _judge_periodic(self) -> None:
        now = self.clock()
        views = None
        if len(self.state.workers) >= OFF_LOOP_WORKERS and self.judge.periodic_due(now):
            views = await self.judge.active_views()  # with turns for the beats arriving meanwhile
        inputs = self.judge.periodic_inputs(now, views)
        if inputs.workers >= OFF_LOOP_WORKERS:
            # At thousands of workers the fleet and quota judgments take 100+ ms of CPU: on a thread (they read
            # only frozen views and copies) the event loop keeps answering beats meanwhile, instead of holding
            # every beat that arrives during the pass (the GIL still shares one core: latency, not throughput), and
            # with finer GIL switching meanwhile, so the writer's commits do not wait behind it (control/cpu_thread.py).
            result = await run_cpu_bound(inputs.run)
        else:
            result = inputs.run()
        changes, events = self.judge.finish_periodic(inputs, result)
        if events:
            await self.log.record_events(events)
        for c in changes:
            w = self.state.workers.get(c.worker_id)
            if w is None or w.state is WorkerState.DEREGISTERED:
                continue
            try:
                await self.directives.set_directive(w, c.patch, c.actor, c.events)
            except errors.ApiError as exc:
                logger.warning("%s could not change %s's directive: %s", c.actor, c.worker_id, exc)

    async def _mark_lost(self, stall_s: float = 0.0) -> list[str]:
        """Mark active workers that missed ``lost_after_beats`` beats lost, durably, each with its event.

        ``stall_s``: how late the pass woke. A pass that starts late ran behind a stalled event loop or process, and
        beats that arrived meanwhile may still wait in sockets, unread: silence is judged as of ``stall_s`` earlier,
        so a stall of the control plane's own is not blamed on its workers (otherwise one long pause of the server
        makes every worker "lost" at once, and their groups get recovered for nothing).

        The workers' locks are held from the check to the apply: a beat or a deregistration being applied finishes
        first and is seen (then the worker is not lost), and one arriving meanwhile waits and finds it lost (a
        rejoin). Without them a deregistration committed during the commit here was overwritten by ``lost``, and a
        beat applied then left the store saying ``lost`` of an active worker."""
        now = self.clock()
        at = now - max(stall_s, 0.0)
        after = self.settings.lost_after_beats
        # Nothing can be overdue before the earliest deadline the last scan saw (or a worker activated since
        # brought in): no scan until then. A pass judging an earlier time than the last scan (a clock stepped back,
        # a stall) scans, whatever the bound says.
        if at + QUIET_MARGIN_S < self.state.quiet_until and at >= self._last_scan_at:
            return []
        candidates, self.state.quiet_until = scan(self.state.workers.values(), at, after)
        self._last_scan_at = at
        if not candidates:
            return []
        async with AsyncExitStack() as held:
            workers = []
            for wid in candidates:  # no other path holds two workers' locks: any order is free of deadlock
                cand = self.state.workers.get(wid)
                if cand is not None:
                    await held.enter_async_context(cand.lock)
                    workers.append(cand)
            workers = [w for w in workers if self.state.workers.get(w.id) is w and overdue((w,), at, after)]
            if not workers:
                return []
            lost = [w.id for w in workers]
            events, rows = [], []
            for w in workers:
                events.append(
                    Event(
                        ts=now,
                        type=EventType.LOST,
                        worker_id=w.id,
                        pool=w.pool,
                        data={"silent_s": round(now - w.last_beat_at, 3), "missed_beats": after},
                    )
                )
                rows.append(replace(w.row(), state=WorkerState.LOST.value))
                run = self.scheduler.run_record(w, True)
                if run is not None:
                    events.append(run)
            with self.state.writing(*lost):  # no dirty copy (still active) between the commit and the apply
                await self.log.commit(WriteBatch(workers=rows, events=events))
                for w in workers:
                    w.state = WorkerState.LOST
        logger.info("workers lost: %s", ", ".join(lost))
        return lost
