"""What the control plane forgets, and when: deregistered workers and old events.

Without it a pool token could fill memory and the database with registrations that ended, and workers with events,
for good. The decisions are pure (``evictable``, ``event_cutoff``); ``ControlPlane.retention`` applies them from the
reconcile loop, at most every ``Settings.retention_interval_s``.

Event types the control plane rebuilds state from at startup are kept whatever their age (``KEPT_TYPES``): the
meltdown counters and breaker levels, rule states, and the device profiles learned from run records. The control
plane decides all of them itself, at a rate its own evidence windows and backoff bound.
"""

from __future__ import annotations

from collections.abc import Iterable

from dsec.control.state import LiveWorker
from dsec.model import EventType, WorkerState

KEPT_TYPES = (EventType.MELTDOWN, EventType.BREAKER, EventType.RECOVERED, EventType.POLICY, EventType.DEVICE)


def evictable(workers: Iterable[LiveWorker], now: float, retention_s: float) -> list[str]:
    """Workers that deregistered at least ``retention_s`` ago."""
    return sorted(
        w.id
        for w in workers
        if w.state is WorkerState.DEREGISTERED and now - (w.ended_at or w.last_beat_at) >= retention_s
    )


def event_cutoff(now: float, retention_s: float) -> float | None:
    """Events older than this are pruned; None keeps them all (retention 0)."""
    return now - retention_s if retention_s > 0 else None


def event_time(sent: float | None, now: float, retention_s: float, max_skew_s: float) -> float:
    """The time an event a worker sent is recorded at: its own clock when plausible, else the server's (a worker
    cannot date its events into the future to outlive retention, or to 0 to hide among the oldest)."""
    if sent is None:
        return now
    oldest = now - retention_s if retention_s > 0 else float("-inf")
    return sent if oldest <= sent <= now + max_skew_s else now
