"""The events a cost report replays, kept between reports, so that a report every minute costs what changed since
the last one rather than a replay of every worker's life.

The executor (``dsec.control.cost``) reads the store and feeds a ``CostLedger`` what was committed since its last
read (by event id); ``report`` then answers what ``account`` answers over a full read of the same store (the
executor's ``CostMeter._account`` with no pool), recomputing the segments of only the workers whose inputs changed.
``tests/unit/test_cost_ledger.py`` holds it to that over generated event streams.

What a full read sees and the ledger must see too:
- the state events (``STATE_TYPES``) with ``since_state <= ts < until``, where ``since_state`` is the earlier of
  the window's start and the earliest registration among the live workers; the workers retention removed come back
  from their ``registered`` events in that range;
- the ``snapshot`` events with ``since <= ts < until``.
A worker's events may arrive late and out of time order (a worker's own clock; a probe's buffer after an outage), so
the ledger keeps everything newer than its horizon and filters by time at each report. What the store's event
retention deletes (30 days by default), the ledger is told to drop too (``forget_pruned``, from the retention pass).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field

from dsec.cost.accounting import CostReport, ProcessUsage, overhead_of, retired_records, snapshot_figures, tally
from dsec.cost.phases import STATE_TYPES, WINDOW_TYPES, Segment, Window, WorkerRecord, clip_segments, worker_segments
from dsec.model import Event, EventType

#: The window a worker's segments are kept for: its whole life (``Window`` takes finite bounds only).
_ALL_TIME = Window(0.0, 1e18)
_STATE = frozenset(STATE_TYPES)
_WINDOW = frozenset(WINDOW_TYPES)


@dataclass
class _Worker:
    """One worker's state events (and the ``recovery`` events that name it) in arrival order, with what decides
    whether its kept segments still hold."""

    events: list[Event] = field(default_factory=list)
    min_ts: float = math.inf
    max_ts: float = -math.inf
    key: tuple[object, ...] | None = None
    segments: Sequence[Segment] = ()

    def add(self, e: Event) -> None:
        self.events.append(e)
        self.min_ts = min(self.min_ts, e.ts)
        self.max_ts = max(self.max_ts, e.ts)


class _SnapshotColumns:
    """One pool's snapshots in time order, a column per figure (a snapshot that did not complete counts 0 and adds
    nothing, but gives the pool its row): a report takes a slice of each column by time."""

    def __init__(self) -> None:
        self.ts: list[float] = []
        self.columns: tuple[list[float], ...] = ([], [], [], [], [])  # completed (1/0), bytes, stage, total, blocking

    def add(self, e: Event) -> None:
        figures = snapshot_figures(e)
        at = bisect.bisect_right(self.ts, e.ts)  # events arrive mostly in time order: nearly always an append
        self.ts.insert(at, e.ts)
        for col, v in zip(self.columns, (1.0, *figures) if figures else (0.0,) * 5, strict=True):
            col.insert(at, v)

    def overhead(self, since: float, until: float) -> dict[str, object] | None:
        lo, hi = bisect.bisect_left(self.ts, since), bisect.bisect_left(self.ts, until)
        if lo >= hi:
            return None
        done, stored, stage, total, blocking = (col[lo:hi] for col in self.columns)
        return overhead_of(int(sum(done)), stored, stage, total, blocking)

    def forget(self, before: float) -> None:
        k = bisect.bisect_left(self.ts, before)
        del self.ts[:k]
        for col in self.columns:
            del col[:k]


class CostLedger:
    """Fed the committed events in id order (``feed``), answers reports over windows that only move forward
    (``report``). ``state_since`` / ``window_since``: the earliest times it holds state and snapshot events from; a
    report that needs earlier ones (``covers`` is False) needs a new ledger read from the store.

    Event ids must grow in commit order (the store's single writer commits them so; ``after_id`` is where the next
    read starts): an id committed below one already read would never be read."""

    def __init__(self, state_since: float, window_since: float) -> None:
        self.state_since = state_since  # the state events before it were never read
        self.window_since = window_since  # the snapshot events before it were never read
        self.after_id = 0  # the newest event id fed
        self._workers: dict[str, _Worker] = {}
        self._registered: list[Event] = []  # every ``registered`` event, in id order (the retired workers')
        self._recoveries: list[Event] = []  # every pool's, for its recovery comparison
        self._snapshots: deque[Event] = deque()  # in id order, for the throughput effects
        self._columns: dict[str, _SnapshotColumns] = {}  # each pool's, for its snapshot overhead

    def covers(self, state_since: float, window_since: float) -> bool:
        return state_since >= self.state_since and window_since >= self.window_since

    def feed(self, events: Iterable[Event]) -> None:
        """Events committed after ``after_id``, in id order (any types: the others are skipped)."""
        for e in events:
            if e.id is not None:
                self.after_id = max(self.after_id, e.id)
            if e.type in _WINDOW:
                self._snapshots.append(e)
                if e.pool:
                    self._columns.setdefault(e.pool, _SnapshotColumns()).add(e)
            elif e.type is EventType.RECOVERY:
                named = e.data.get("worker")
                if isinstance(named, str):
                    self._workers.setdefault(named, _Worker()).add(e)
                self._recoveries.append(e)
            elif e.type in _STATE and e.worker_id is not None:
                self._workers.setdefault(e.worker_id, _Worker()).add(e)
                if e.type is EventType.REGISTERED:
                    self._registered.append(e)

    def report(
        self,
        live: Sequence[WorkerRecord],
        window: Window,
        now: float,
        price_per_device_hour: float = 0.0,
        process: ProcessUsage | None = None,
        throughput: bool = True,
    ) -> CostReport:
        """The report over ``window`` for the ``live`` workers and those retention removed (``account``'s; without
        the per-worker throughput effects when ``throughput`` is False)."""
        state_since = min([window.since, *(w.registered_at for w in live)])
        if not self.covers(state_since, window.since):
            raise ValueError(
                f"the ledger holds events from {self.state_since} (state) and {self.window_since} (snapshots); "
                f"this report needs them from {state_since} and {window.since}: read the store again"
            )
        until = min(window.until, now)
        known = {w.id for w in live}
        retired = retired_records([e for e in self._registered if state_since <= e.ts < until], known, None)
        workers = [*live, *retired]

        def segments_of(w: WorkerRecord, handovers: Sequence[float]) -> Sequence[Segment]:
            kept = self._workers.get(w.id) or _Worker()
            if kept.min_ts < state_since or kept.max_ts >= until:
                # Events a full read leaves out (before its range, or not yet in it): replayed without them.
                evs = [e for e in kept.events if state_since <= e.ts < until]
                return worker_segments(w, evs, window, handovers, now)
            key = (w.registered_at, w.ended_at, w.progressed, len(kept.events), tuple(handovers))
            if kept.key != key:
                kept.key = key
                kept.segments = worker_segments(w, kept.events, _ALL_TIME, handovers, None)
            return clip_segments(kept.segments, window.since, until)

        by_pool: dict[str, list[Event]] = {}
        for e in [*self._recoveries, *(self._snapshots if throughput else ())]:
            if e.pool and window.since <= e.ts < until:
                by_pool.setdefault(e.pool, []).append(e)
        overheads = {}
        for pool, columns in self._columns.items():
            if (overhead := columns.overhead(window.since, until)) is not None:
                overheads[pool] = overhead
        out = tally(workers, segments_of, by_pool, window, price_per_device_hour, process, overheads, throughput)
        self._forget(state_since, window.since)
        return out

    def forget_pruned(self, before: float, kept: Collection[EventType]) -> None:
        """Drop what the store's event retention deleted (control/retention.py: every event older than ``before``
        whose type is not ``kept``), so that a report stays what a full read of the store answers: a live worker
        older than the retention keeps its registration and its kept events only."""

        def gone(e: Event) -> bool:
            return e.ts < before and e.type not in kept

        for wid, w in list(self._workers.items()):
            if w.min_ts >= before or not any(gone(e) for e in w.events):
                continue
            left = _Worker()
            for e in w.events:
                if not gone(e):
                    left.add(e)
            if left.events:
                self._workers[wid] = left  # a new key: its segments are recomputed
            else:
                del self._workers[wid]
        self._registered = [e for e in self._registered if not gone(e)]
        self._recoveries = [e for e in self._recoveries if not gone(e)]
        self._snapshots = deque(e for e in self._snapshots if not gone(e))
        if EventType.SNAPSHOT not in kept:
            for columns in self._columns.values():
                columns.forget(before)

    def _forget(self, state_since: float, window_since: float) -> None:
        """Drop what no later report can read: reports only move forward (``covers``), so a full read would never
        again see a state event before ``state_since`` nor a snapshot before ``window_since``."""
        self.state_since = max(self.state_since, state_since)
        self.window_since = max(self.window_since, window_since)
        # Snapshots arrive nearly in time order: drop from the front what is old (a late one behind a newer one
        # waits for it; a report skips it by time).
        while self._snapshots and self._snapshots[0].ts < self.window_since:
            self._snapshots.popleft()
        for columns in self._columns.values():
            columns.forget(self.window_since)
        if any(e.ts < self.window_since for e in self._recoveries):
            self._recoveries = [e for e in self._recoveries if e.ts >= self.window_since]
        if any(e.ts < self.state_since for e in self._registered):
            self._registered = [e for e in self._registered if e.ts >= self.state_since]
        for wid, kept in list(self._workers.items()):
            if kept.min_ts >= self.state_since:
                continue
            old = kept.events
            del self._workers[wid]
            for e in old:
                if e.ts >= self.state_since:
                    self._workers.setdefault(wid, _Worker()).add(e)
