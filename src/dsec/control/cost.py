"""The executor of cost accounting: reads the workers (hot state), their events (the store, off the event loop) and
the process itself, and hands them to the pure ``dsec.cost.account``. Also keeps the last hour's report for the
``dsec_cost_*`` gauges, recomputed by the reconcile loop every ``cost_refresh_s`` from a ``dsec.cost.CostLedger``:
each refresh reads only the events committed since the last one (a full replay of every worker's life every minute
held the GIL ~0.6 s at 10,000 workers, docs/benchmarks.md "Soak and crash")."""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence

import psutil

from dsec.control.cpu_thread import run_cpu_bound
from dsec.control.ports import Clock
from dsec.control.settings import Settings
from dsec.control.state import HotState, LiveWorker
from dsec.control.store import EventQuery, Store
from dsec.cost import PROGRESS_METRICS, STATE_TYPES, WINDOW_TYPES, CostReport, ProcessUsage, Window, WorkerRecord
from dsec.cost import account as account_events
from dsec.cost.accounting import retired_records
from dsec.cost.ledger import CostLedger
from dsec.model import Event, EventType, WorkerState

log = logging.getLogger(__name__)

#: At most this many events are read for one report; beyond it the report says so in ``notes``.
MAX_EVENTS = 200_000
DEFAULT_WINDOW_S = 3600.0


def worker_record(w: LiveWorker) -> WorkerRecord:
    """A live worker as the accounting sees it: one device when it names one (unknown otherwise), progress from its
    latest cumulative counters, its end from its deregistration (its last beat after a restart)."""
    ended = None
    if w.state is WorkerState.DEREGISTERED:
        ended = w.ended_at if w.ended_at is not None else w.last_beat_at
    metrics = w.metrics
    progressed = any(float(metrics.get(name, 0.0)) > 0 for name in PROGRESS_METRICS)
    step_ms = metrics.get("step_ms_mean")
    return WorkerRecord(
        id=w.id,
        pool=w.pool,
        group=w.info.group,
        registered_at=w.registered_at,
        ended_at=ended,
        device=w.info.device,
        devices=1 if w.info.device else None,
        progressed=progressed,
        step_ms=float(step_ms) if step_ms is not None and math.isfinite(step_ms) and step_ms > 0 else None,
    )


def read_events(
    store: Store,
    types: Sequence[EventType],
    pool: str | None,
    since: float | None,
    until: float | None,
    after_id: int = 0,
) -> list[Event]:
    """Every event of ``types`` in [since, until) (of ``pool`` when given; None: unbounded) with an id above
    ``after_id``, in id order, paged, up to :data:`MAX_EVENTS`."""
    out: list[Event] = []
    after = after_id
    while len(out) < MAX_EVENTS:
        q = EventQuery(pool=pool, types=tuple(types), since=since, until=until, after_id=after, limit=1000)
        page = store.query_events(q)
        out.extend(page)
        if len(page) < 1000:
            break
        after = page[-1].id or after
    return out


def process_usage(started_at: float, now: float) -> ProcessUsage:
    proc = psutil.Process(os.getpid())
    with proc.oneshot():
        cpu = proc.cpu_times()
        rss = proc.memory_info().rss
    return ProcessUsage(cpu_s=cpu.user + cpu.system, rss_bytes=int(rss), uptime_s=max(0.0, now - started_at))


class CostMeter:
    """Cost reports on demand (``GET /v1/cost``) and the last hour's, kept for the Prometheus collector."""

    def __init__(self, state: HotState, store: Store, settings: Settings, clock: Clock, started_at: float) -> None:
        self.state = state
        self.store = store
        self.settings = settings
        self.clock = clock
        self.started_at = started_at
        self.last: CostReport | None = None
        self._refreshed_at = -math.inf
        self._ledger: CostLedger | None = None  # the gauges' events, kept between refreshes
        # What the retention pass deleted since the last refresh (before, kept types): the ledger drops the same at
        # the next refresh, on the refresh's thread (the ledger is used there only).
        self._pruned: list[tuple[float, tuple[EventType, ...]]] = []

    async def report(self, window: Window, pool: str | None = None) -> CostReport:
        """The report over ``window`` (nothing is allocated after now: the future holds no device)."""
        now = self.clock()
        live = [
            worker_record(w)
            for w in list(self.state.workers.values())
            if (pool is None or w.pool == pool) and w.registered_at < window.until
        ]
        return await run_cpu_bound(self._account, live, window, pool, now)

    def _account(self, live: list[WorkerRecord], window: Window, pool: str | None, now: float) -> CostReport:
        # The state replay needs each worker's whole life: from the earliest registration still held (or the
        # window's start, for the registrations of workers retention removed since).
        since_state = min([window.since, *(w.registered_at for w in live)])
        until = min(window.until, now)
        state_events = read_events(self.store, STATE_TYPES, pool, since_state, until) if until > since_state else []
        window_events = read_events(self.store, WINDOW_TYPES, pool, window.since, until) if until > window.since else []
        known = {w.id for w in live}
        workers = live + retired_records(state_events, known, pool)
        report = account_events(
            workers,
            [*state_events, *window_events],
            window,
            self.settings.cost_device_hour,
            process_usage(self.started_at, now),
            now,
        )
        if len(state_events) >= MAX_EVENTS or len(window_events) >= MAX_EVENTS:
            report.notes.append(f"truncated: more than {MAX_EVENTS} events in the window; the oldest were read")
        return report

    def forget_pruned(self, before: float, kept: Sequence[EventType]) -> None:
        """The store's retention deleted every event older than ``before`` not of a ``kept`` type."""
        self._pruned.append((before, tuple(kept)))

    async def refresh(self) -> None:
        """Recompute the last hour's report when ``cost_refresh_s`` has passed (from the reconcile loop)."""
        now = self.clock()
        if now - self._refreshed_at < self.settings.cost_refresh_s:
            return
        self._refreshed_at = now
        try:
            window = Window(max(0.0, now - DEFAULT_WINDOW_S), now)
            live = [worker_record(w) for w in list(self.state.workers.values()) if w.registered_at < window.until]
            self.last = await run_cpu_bound(self._gauge_report, live, window, now)
        except Exception:  # the gauges keep the previous report; the next pass retries
            self._ledger = None  # and reads the store afresh
            log.exception("cost report for the gauges failed")

    def _gauge_report(
        self, live: list[WorkerRecord], window: Window, now: float, throughput: bool = False
    ) -> CostReport:
        """The gauges' report from the ledger, fed what was committed since the last refresh. The first refresh (and
        one whose window reaches back past what the ledger holds) reads the store as a full report would, but with no
        upper time bound: the ids it passes are never read again. A first read that hits :data:`MAX_EVENTS` is used
        for this report only (truncated, as a full report is); a later read that hits it continues at the next
        refresh. The report says either. The gauges show no throughput effects, so by default none are computed."""
        state_since = min([window.since, *(w.registered_at for w in live)])
        ledger = self._ledger
        pruned, self._pruned = self._pruned, []
        if ledger is not None:
            for before, kept in pruned:
                ledger.forget_pruned(before, kept)
        notes = []
        if ledger is None or not ledger.covers(state_since, window.since):
            ledger = CostLedger(state_since, window.since)
            state = read_events(self.store, STATE_TYPES, None, state_since, None)
            snaps = read_events(self.store, WINDOW_TYPES, None, window.since, None)
            ledger.feed(state + snaps)
            truncated = len(state) >= MAX_EVENTS or len(snaps) >= MAX_EVENTS
            self._ledger = None if truncated else ledger
            if truncated:
                notes.append(f"truncated: more than {MAX_EVENTS} events in the window; the oldest were read")
        else:
            fresh = read_events(self.store, (*STATE_TYPES, *WINDOW_TYPES), None, None, None, ledger.after_id)
            ledger.feed(fresh)
            if len(fresh) >= MAX_EVENTS:
                notes.append(f"catching up: more than {MAX_EVENTS} new events; the rest are read at the next refresh")
        usage = process_usage(self.started_at, now)
        report = ledger.report(live, window, now, self.settings.cost_device_hour, usage, throughput)
        report.notes.extend(notes)
        return report
