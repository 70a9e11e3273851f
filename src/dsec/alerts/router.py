"""Alert routing: deduplicate, group and rate-limit alerts, then hand them to sinks.

Modelled on Prometheus Alertmanager, adapted to alerts that are events (they never "resolve"):

* **Group** = ``(pool, alert name)``. All workers of a pool raising the same alert share a group, so a
  pool-wide problem is one notification listing the workers, not one per worker. (Alert names that
  embed a worker id, e.g. ``w-abc_episode_stuck``, naturally get a group of their own.)
* **Alert identity** = ``Alert.key`` = ``(name, pool, worker_id)``.
* **group_wait_s**: a new group's first notification goes out this long after its first alert, so
  alerts that arrive together (a whole pool melting down) are batched into one notification.
* **group_interval_s**: after a group has notified, it notifies again at most this often, and only
  when it has something to send: an alert key not sent before, or one whose repeat interval is over.
* **repeat_interval_s**: an alert key that was sent is not sent again for this long. Arrivals in
  between are folded: the newest instance is kept and the older ones are counted. Once the interval
  is over the newest instance goes out with the group's next notification, and
  ``Notification.count`` reports how many arrivals were folded into its alerts. So every arrival is
  either sent or counted in a later notification; nothing is silently lost (except what ``close``
  finds still inside a repeat interval, which it logs).
* A group with nothing unsent whose last notification is older than both intervals is forgotten;
  the next alert for it starts a fresh group (and waits ``group_wait_s`` again).

Consequence for a flapping worker: with the defaults, an alert repeated every 100 ms produces one
notification after 1 s and then one every 300 s carrying the count, instead of ten per second.

``AlertGrouper`` holds all of that logic and is pure: no threads, no I/O, the time is an argument.
``AlertRouter`` is the thin thread shell around it: ``submit`` never blocks, one ``dsec-alerts``
thread feeds the grouper and calls the sinks, so a slow webhook delays alerts but never a caller.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from dsec.alerts.model import Alert, AlertKey, Severity

log = logging.getLogger(__name__)

#: ``(pool, alert name)``
GroupKey = tuple[str | None, str]


@dataclass(frozen=True)
class Notification:
    """One message to the sinks: the alerts of one group that are due, newest instance per key.

    ``count`` is the number of arrivals folded into these alerts (duplicates not sent on their own)
    since each key was last sent; ``first_seen`` is when the group got its first alert; ``at`` is when
    the grouper decided to send.
    """

    group: GroupKey
    alerts: tuple[Alert, ...]
    first_seen: float
    count: int
    at: float

    @property
    def severity(self) -> Severity:
        """The most severe of the alerts: what the notification as a whole is logged or paged at."""
        return max((a.severity for a in self.alerts), key=lambda s: s.rank, default=Severity.INFO)

    def to_dict(self) -> dict[str, Any]:
        return {
            "group": {"pool": self.group[0], "name": self.group[1]},
            "severity": self.severity.value,
            "alerts": [a.to_dict() for a in self.alerts],
            "count": self.count,
            "first_seen": self.first_seen,
            "at": self.at,
        }


class Sink(Protocol):
    """Where notifications go. ``deliver`` raises on failure; the router logs it and counts it."""

    def deliver(self, notification: Notification) -> None: ...


@dataclass
class _Unsent:
    alert: Alert  # the newest arrival for the key
    folded: int  # older arrivals it replaced since the key was last sent


class _Group:
    __slots__ = ("first_seen", "last_flush", "last_sent", "next_flush", "unsent")

    def __init__(self, now: float, group_wait_s: float) -> None:
        self.first_seen = now
        self.next_flush = now + group_wait_s
        self.last_flush: float | None = None
        self.unsent: dict[AlertKey, _Unsent] = {}
        self.last_sent: dict[AlertKey, float] = {}


def _interval(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value!r} is invalid: expected a finite number of seconds >= 0")
    return float(value)


class AlertGrouper:
    """The routing decisions, without threads or clocks (see the module docstring for the semantics).

    Not thread-safe: one owner calls ``add`` and ``due``/``flush`` with non-decreasing ``now``.
    """

    def __init__(self, group_wait_s: float = 1.0, group_interval_s: float = 5.0, repeat_interval_s: float = 300.0):
        self.group_wait_s = _interval("group_wait_s", group_wait_s)
        self.group_interval_s = _interval("group_interval_s", group_interval_s)
        self.repeat_interval_s = _interval("repeat_interval_s", repeat_interval_s)
        self._groups: dict[GroupKey, _Group] = {}
        #: Alerts added, and arrivals folded into a newer instance of the same key (never sent themselves).
        self.received = 0
        self.suppressed = 0

    def add(self, alert: Alert, now: float) -> None:
        self.received += 1
        gk: GroupKey = (alert.pool, alert.name)
        group = self._groups.get(gk)
        if group is None:
            group = self._groups[gk] = _Group(now, self.group_wait_s)
        unsent = group.unsent.get(alert.key)
        if unsent is None:
            group.unsent[alert.key] = _Unsent(alert, 0)
        else:
            unsent.alert = alert
            unsent.folded += 1
            self.suppressed += 1

    def due(self, now: float) -> list[Notification]:
        """The notifications to send at ``now`` under the group timers; forgets groups gone quiet."""
        return self._collect(now, respect_timers=True)

    def flush(self, now: float) -> list[Notification]:
        """Everything sendable now ignoring group_wait/group_interval (shutdown); repeat_interval still holds."""
        return self._collect(now, respect_timers=False)

    def next_due(self, now: float) -> float | None:
        """The earliest time ``due`` may return something, or None when nothing is waiting."""
        best: float | None = None
        for group in self._groups.values():
            if not group.unsent:
                continue
            ready = min(self._ready_at(group, key) for key in group.unsent)
            at = max(group.next_flush, ready)
            best = at if best is None else min(best, at)
        return None if best is None else max(best, now)

    @property
    def pending(self) -> int:
        """Alert keys waiting to be sent (for the group timers or their repeat interval)."""
        return sum(len(g.unsent) for g in self._groups.values())

    @property
    def groups(self) -> int:
        return len(self._groups)

    def _ready_at(self, group: _Group, key: AlertKey) -> float:
        sent = group.last_sent.get(key)
        return -math.inf if sent is None else sent + self.repeat_interval_s

    def _collect(self, now: float, respect_timers: bool) -> list[Notification]:
        out: list[Notification] = []
        forget_after = max(self.group_interval_s, self.repeat_interval_s)
        for gk, group in list(self._groups.items()):
            if group.unsent and (not respect_timers or now >= group.next_flush):
                note = self._emit(gk, group, now)
                if note is not None:
                    out.append(note)
            if not group.unsent and group.last_flush is not None and now >= group.last_flush + forget_after:
                del self._groups[gk]
        return out

    def _emit(self, gk: GroupKey, group: _Group, now: float) -> Notification | None:
        # Keys past their repeat interval behave as never sent; dropping them keeps the map small.
        for key in [k for k, t in group.last_sent.items() if now >= t + self.repeat_interval_s]:
            del group.last_sent[key]
        ready = [k for k in group.unsent if k not in group.last_sent]
        if not ready:
            return None
        alerts: list[Alert] = []
        count = 0
        for key in ready:
            unsent = group.unsent.pop(key)
            alerts.append(unsent.alert)
            count += unsent.folded
            group.last_sent[key] = now
        group.last_flush = now
        group.next_flush = now + self.group_interval_s
        return Notification(group=gk, alerts=tuple(alerts), first_seen=group.first_seen, count=count, at=now)


class AlertRouter:
    """Thread shell around ``AlertGrouper``: thread-safe, non-blocking ``submit``; one delivery thread.

    The router owns its sinks: ``close`` closes those that have a ``close()``. Counters: ``delivered``
    and ``failed`` count (notification, sink) deliveries, ``dropped`` alerts lost to a full queue or
    submitted after close, ``suppressed`` arrivals folded into a newer instance.
    """

    def __init__(
        self,
        sinks: Iterable[Sink],
        group_wait_s: float = 1.0,
        group_interval_s: float = 5.0,
        repeat_interval_s: float = 300.0,
        clock: Callable[[], float] = time.time,
        max_queue: int = 10_000,
        tick_s: float = 0.1,
    ) -> None:
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 1:
            raise ValueError(f"max_queue={max_queue!r} is invalid: expected an int >= 1")
        self._tick = _interval("tick_s", tick_s)
        self._sinks = list(sinks)
        self._grouper = AlertGrouper(group_wait_s, group_interval_s, repeat_interval_s)
        self._clock = clock
        self._queue: deque[Alert] = deque(maxlen=max_queue)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._closed = False
        self.delivered = 0
        self.failed = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="dsec-alerts", daemon=True)
        self._thread.start()

    @property
    def suppressed(self) -> int:
        return self._grouper.suppressed

    @property
    def sinks(self) -> tuple[Sink, ...]:
        return tuple(self._sinks)

    def submit(self, alert: Alert) -> None:
        """Queue ``alert``; never blocks. A full queue drops its oldest alert (a burst keeps the newest)."""
        with self._lock:
            if self._closed:
                self.dropped += 1
                return
            if len(self._queue) == self._queue.maxlen:
                self.dropped += 1
            self._queue.append(alert)
        self._wake.set()

    def close(self, timeout: float = 2.0) -> None:
        """Send what is pending (ignoring the group timers), stop and join the thread, close the sinks."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("alert router did not stop within %.1f s (a sink is slow); closing its sinks", timeout)
        elif self._grouper.pending:
            log.info(
                "alert router closed with %d alert(s) inside their repeat interval, not sent", self._grouper.pending
            )
        for sink in self._sinks:
            close = getattr(sink, "close", None)
            if callable(close):
                try:
                    close()
                except Exception as exc:
                    log.warning("closing alert sink %r failed: %s", sink, exc)

    def alive(self) -> bool:
        return self._thread.is_alive()

    def __enter__(self) -> AlertRouter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.clear()
            stopping = self._stop.is_set()
            try:
                self._cycle(final=stopping)
            except Exception:  # a bug here must not kill alerting for the rest of the process
                log.exception("alert router cycle failed")
            if stopping:
                return
            now = self._clock()
            next_due = self._grouper.next_due(now)
            wait = self._tick if next_due is None else min(self._tick, max(0.0, next_due - now))
            self._wake.wait(wait)

    def _cycle(self, final: bool) -> None:
        with self._lock:
            items = list(self._queue)
            self._queue.clear()
        now = self._clock()
        for alert in items:
            self._grouper.add(alert, now)
        for note in self._grouper.flush(now) if final else self._grouper.due(now):
            self._deliver(note)

    def _deliver(self, note: Notification) -> None:
        for sink in self._sinks:
            try:
                sink.deliver(note)
            except Exception as exc:  # one broken sink must not starve the others
                self.failed += 1
                log.warning("alert sink %r failed for group %s: %s", sink, note.group, exc)
            else:
                self.delivered += 1
