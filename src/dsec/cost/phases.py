"""Cost accounting over recorded events: who held devices, doing what, and what DSec itself cost.

Pure: every function takes records (workers as the store keeps them, events as the event log recorded them) and a
window, and returns a typed result. The control plane's executor (``dsec.control.cost``) reads the store and the
process; the formulas are in docs/observability.md ("Cost accounting").

Phases of a worker, at any moment of its allocation (registration to deregistration, clipped to the window):

- ``recovering``: after a failure of the worker (``lost``, or the ``recovery`` event of a launcher that names it, from
  ``ts - total_s``) until it comes back (``rejoined``), restores (``restore``), the launcher's ``recovery`` event,
  another worker registers on its device, or it ends; and a worker whose first event after registration is a
  ``restore``, from its registration to that restore (it was rebuilding its state);
- ``idle``: otherwise, when its latest metrics show no progress (no ``updates_total``/``steps_total``/
  ``env_steps_total``/``episodes_total`` above 0);
- ``degraded``: otherwise, while its breaker level (``level_to`` of its last ``meltdown``/``breaker``/``recovered``
  event) is 1 or more;
- ``useful``: the rest.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dsec.errors import InvalidInput
from dsec.model import Event, EventType

PHASES = ("useful", "degraded", "recovering", "idle")
PROGRESS_METRICS = ("updates_total", "steps_total", "env_steps_total", "episodes_total")
# What the state replay reads; the executor queries these over each worker's whole life. A launcher's ``recovery``
# event is among them: one from before the window can end a failure that began before it (read within the window
# only, such a worker stayed "recovering" through every later window).
STATE_TYPES = (
    EventType.REGISTERED,
    EventType.DEREGISTERED,
    EventType.LOST,
    EventType.REJOINED,
    EventType.MELTDOWN,
    EventType.BREAKER,
    EventType.RECOVERED,
    EventType.RESTORE,
    EventType.RECOVERY,
)
# What is read within the window only.
WINDOW_TYPES = (EventType.SNAPSHOT,)
Z95 = 1.959963984540054
PROBE_OVERHEAD_NOTE = "the probe reports no per-step overhead metric (dsec.telemetry declares none)"
METRIC_HISTORY_NOTE = (
    "grad_norm / episode_return_mean: the control plane keeps only each worker's latest value, no history to split "
    "by period"
)
NO_THROUGHPUT_NOTE = "throughput: not computed for this report (the gauges' hourly report; GET /v1/cost has it)"


class WindowError(InvalidInput, ValueError):
    """A window that is not one: names the field at fault."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


@dataclass(frozen=True)
class Window:
    since: float
    until: float

    def __post_init__(self) -> None:
        for name in ("since", "until"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise WindowError(name, f"{name}={v!r} is invalid: expected unix seconds, a finite number >= 0")
        if self.until <= self.since:
            raise WindowError("until", f"until={self.until!r} is invalid: expected a time after since={self.since!r}")

    @property
    def seconds(self) -> float:
        return self.until - self.since


@dataclass(frozen=True)
class WorkerRecord:
    """A worker as the store keeps it. ``devices`` None: unknown (counted as 1, listed as estimated);
    ``progressed`` None: unknown (the worker's row is gone; counted as progressing, listed as estimated)."""

    id: str
    pool: str
    group: str = "default"
    registered_at: float = 0.0
    ended_at: float | None = None
    device: str | None = None
    devices: int | None = None
    progressed: bool | None = True
    step_ms: float | None = None


@dataclass(frozen=True)
class Segment:
    start: float
    end: float
    phase: str
    level: int = 0

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Hours:
    """Device-hours by phase; ``total`` is their sum."""

    useful: float = 0.0
    degraded: float = 0.0
    recovering: float = 0.0
    idle: float = 0.0

    @property
    def total(self) -> float:
        return self.useful + self.degraded + self.recovering + self.idle

    def add(self, phase: str, hours: float) -> None:
        setattr(self, phase, getattr(self, phase) + hours)

    def to_dict(self) -> dict[str, float]:
        return {"total": self.total, **{p: getattr(self, p) for p in PHASES}}

    def priced(self, price: float) -> dict[str, float]:
        return {k: v * price for k, v in self.to_dict().items()}


@dataclass(frozen=True)
class Interval:
    """Mean with a 95% confidence interval (normal approximation); None where n is too small."""

    n: int
    mean: float | None
    ci95: tuple[float, float] | None

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, "mean": self.mean, "ci95": list(self.ci95) if self.ci95 else None}


def mean_ci(xs: Sequence[float]) -> Interval:
    """Mean and ``mean ± 1.96·s/√n`` (s: the sample standard deviation); no interval below n = 2."""
    n = len(xs)
    if n == 0:
        return Interval(0, None, None)
    m = statistics.fmean(xs)
    if n < 2:
        return Interval(n, m, None)
    half = Z95 * statistics.stdev(xs) / math.sqrt(n)
    return Interval(n, m, (m - half, m + half))


def diff_ci(a: Sequence[float], b: Sequence[float]) -> Interval:
    """Mean of ``a`` minus mean of ``b`` with ``± 1.96·√(s_a²/n_a + s_b²/n_b)`` (Welch, normal approximation)."""
    if len(a) < 2 or len(b) < 2:
        n = min(len(a), len(b))
        m = statistics.fmean(a) - statistics.fmean(b) if a and b else None
        return Interval(n, m, None)
    m = statistics.fmean(a) - statistics.fmean(b)
    half = Z95 * math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    return Interval(min(len(a), len(b)), m, (m - half, m + half))


def number_of(data: Mapping[str, Any], key: str) -> float | None:
    v = data.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return None
    return float(v)


def _ok_restore(ev: Event) -> bool:
    return ev.type is EventType.RESTORE and ev.data.get("status", "ok") == "ok"


def worker_segments(
    w: WorkerRecord,
    events: Sequence[Event],
    window: Window,
    handovers: Sequence[float] = (),
    now: float | None = None,
) -> list[Segment]:
    """The worker's phases within ``window`` (and before ``now``: the future holds no device). ``events``: the
    worker's state events (any order, any time) and the ``recovery`` events that name it; ``handovers``: times
    another worker registered on its device."""
    evs = sorted(events, key=lambda e: (e.ts, e.id or 0))
    end = w.ended_at
    for e in evs:
        if e.type is EventType.DEREGISTERED and e.worker_id == w.id:
            end = e.ts if end is None else min(end, e.ts)
    start = w.registered_at
    stop = min(window.until, end if end is not None else window.until, now if now is not None else window.until)
    first = next((e for e in evs if e.type is not EventType.REGISTERED and e.worker_id == w.id), None)
    restoring_at_start = first is not None and _ok_restore(first)
    marks = _marks(w, evs, start, handovers)
    level = 0
    failed, restoring = False, restoring_at_start
    out: list[Segment] = []

    def phase() -> str:
        if failed or restoring:
            return "recovering"
        if w.progressed is False:
            return "idle"
        return "degraded" if level >= 1 else "useful"

    cursor = start
    for t, _, what, value in marks:
        if t > cursor:
            _emit(out, cursor, min(t, stop), phase(), level, window)
            cursor = max(cursor, t)
        if what == "level":
            level = value
        elif what == "fail":
            failed = value
        elif what == "restoring":
            restoring = value
        elif what == "handover" and failed:
            stop = min(stop, max(t, start))  # the device went to another worker: this one holds nothing any more
        if cursor >= stop:
            break
    if cursor < stop:
        _emit(out, cursor, stop, phase(), level, window)
    return out


def _marks(
    w: WorkerRecord, evs: Sequence[Event], start: float, handovers: Sequence[float]
) -> list[tuple[float, int, str, Any]]:
    """Changes of the worker's state, each (ts, order, what, value), in the time order they are replayed in;
    ``evs`` sorted by time."""
    marks: list[tuple[float, int, str, Any]] = []
    for i, e in enumerate(evs):
        if e.type is EventType.RECOVERY:
            total = number_of(e.data, "total_s") or 0.0
            marks.append((max(start, e.ts - total), i, "fail", True))
            marks.append((e.ts, i, "fail", False))
            continue
        if e.worker_id != w.id:
            continue
        if e.type in (EventType.MELTDOWN, EventType.BREAKER, EventType.RECOVERED):
            to = e.data.get("level_to")
            if isinstance(to, int) and not isinstance(to, bool):
                marks.append((e.ts, i, "level", to))
        elif e.type is EventType.LOST:
            marks.append((e.ts, i, "fail", True))
        elif e.type is EventType.REJOINED:
            marks.append((e.ts, i, "fail", False))
        elif _ok_restore(e):
            marks.append((e.ts, i, "fail", False))
            marks.append((e.ts, i, "restoring", False))
    for t in handovers:
        marks.append((t, len(evs), "handover", True))
    marks.sort(key=lambda m: (m[0], m[1]))
    return marks


def clip_segments(segments: Sequence[Segment], since: float, until: float) -> list[Segment]:
    """``segments`` (as ``worker_segments`` returns them) cut to [since, until). Cutting the segments of a wider
    window gives what ``worker_segments`` gives for the narrower one: its merges join only segments that touch, and
    cutting separates none that touch within the cut."""
    out = []
    for s in segments:
        lo, hi = max(s.start, since), min(s.end, until)
        if hi > lo:
            out.append(s if (lo, hi) == (s.start, s.end) else Segment(lo, hi, s.phase, s.level))
    return out


def _emit(out: list[Segment], a: float, b: float, phase: str, level: int, window: Window) -> None:
    lo, hi = max(a, window.since), min(b, window.until)
    if hi <= lo:
        return
    same = out and out[-1].phase == phase and (out[-1].level == level or phase in ("idle", "recovering"))
    if same and out[-1].end == lo:
        out[-1] = Segment(out[-1].start, hi, phase, level)
    else:
        out.append(Segment(lo, hi, phase, level))
