"""Cost accounting over recorded events: the report per pool and group, DSec's own overhead (snapshots), and the
opportunity cost of degrading (throughput with confidence intervals, heals vs restarts).

Pure: every function takes records (workers as the store keeps them, events as the event log recorded them) and a
window, and returns a typed result. The control plane's executor (``dsec.control.cost``) reads the store and the
process; the phases are in ``dsec.cost.phases``, the formulas in docs/observability.md ("Cost accounting").
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsec import pacing
from dsec.cost.phases import (
    METRIC_HISTORY_NOTE,
    NO_THROUGHPUT_NOTE,
    PHASES,
    PROBE_OVERHEAD_NOTE,
    Hours,
    Segment,
    Window,
    WorkerRecord,
    diff_ci,
    mean_ci,
    number_of,
    worker_segments,
)
from dsec.model import Event, EventType


@dataclass(frozen=True)
class ProcessUsage:
    """The control-plane process, measured by the executor: CPU seconds and RSS now, since it started."""

    cpu_s: float
    rss_bytes: int
    uptime_s: float

    def to_dict(self) -> dict[str, Any]:
        share = self.cpu_s / self.uptime_s if self.uptime_s > 0 else None
        return {"cpu_s": self.cpu_s, "rss_bytes": self.rss_bytes, "uptime_s": self.uptime_s, "cpu_share": share}


@dataclass
class GroupCost:
    hours: Hours = field(default_factory=Hours)
    workers: int = 0


@dataclass
class PoolCost:
    """One pool's accounting over the window."""

    pool: str
    hours: Hours = field(default_factory=Hours)
    workers: int = 0
    groups: dict[str, GroupCost] = field(default_factory=dict)
    snapshots: dict[str, Any] = field(default_factory=dict)
    degraded_steps: float | None = None
    throughput: list[dict[str, Any]] = field(default_factory=list)
    recoveries: dict[str, Any] = field(default_factory=dict)

    def to_dict(self, price: float) -> dict[str, Any]:
        return {
            "pool": self.pool,
            "workers": self.workers,
            "device_hours": self.hours.to_dict(),
            "cost": self.hours.priced(price),
            "groups": {
                g: {"workers": c.workers, "device_hours": c.hours.to_dict(), "cost": c.hours.priced(price)}
                for g, c in sorted(self.groups.items())
            },
            "implicit": {"snapshots": self.snapshots, "probe_overhead_ms_per_step": None},
            "opportunity": {
                "degraded_steps": self.degraded_steps,
                "throughput": self.throughput,
                "grad_norm": None,
                "episode_return": None,
                "recoveries": self.recoveries,
            },
        }


@dataclass
class CostReport:
    window: Window
    price_per_device_hour: float
    pools: dict[str, PoolCost]
    process: ProcessUsage | None = None
    estimated: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def hours(self) -> Hours:
        out = Hours()
        for p in self.pools.values():
            for ph in PHASES:
                out.add(ph, getattr(p.hours, ph))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "since": self.window.since,
            "until": self.window.until,
            "price_per_device_hour": self.price_per_device_hour,
            "device_hours": self.hours.to_dict(),
            "cost": self.hours.priced(self.price_per_device_hour),
            "pools": [p.to_dict(self.price_per_device_hour) for _, p in sorted(self.pools.items())],
            "implicit": {
                "process": self.process.to_dict() if self.process else None,
                "probe_overhead_ms_per_step": None,
            },
            "estimated": self.estimated,
            "notes": self.notes,
        }


#: One ``snapshot`` event's figures: bytes stored, stage ms, background (total) ms, blocking ms.
SnapshotFigures = tuple[float, float, float, float]


def snapshot_figures(e: Event) -> SnapshotFigures | None:
    """What ``snapshot_overhead`` sums of one event; None for any other event and a snapshot that did not complete."""
    if e.type is not EventType.SNAPSHOT or e.data.get("status", "ok") != "ok":
        return None
    d = e.data
    return (
        number_of(d, "bytes") or number_of(d, "stored_bytes") or 0.0,
        number_of(d, "stage_ms") or 0.0,
        number_of(d, "total_ms") or 0.0,
        number_of(d, "blocking_ms") or 0.0,
    )


def snapshot_overhead(events: Iterable[Event]) -> dict[str, Any]:
    """Snapshots written in the window: count, bytes stored, and the time they took (``stage_ms`` in the training
    loop's way, ``total_ms`` in the background), summed from the ``snapshot`` events' data."""
    figures = [f for e in events if (f := snapshot_figures(e)) is not None]
    stored, stage, total, blocking = zip(*figures, strict=True) if figures else ((), (), (), ())
    return overhead_of(len(figures), stored, stage, total, blocking)


def overhead_of(
    count: int, stored: Iterable[float], stage: Iterable[float], total: Iterable[float], blocking: Iterable[float]
) -> dict[str, Any]:
    """``snapshot_overhead`` from the completed snapshots' figures, column by column. The sums are exact
    (``math.fsum``), so they do not depend on the order the snapshots are summed in: ``dsec.cost.ledger`` keeps them
    in time order, a full read in commit order."""
    return {
        "count": count,
        "bytes": math.fsum(stored),
        "stage_s": math.fsum(stage) / 1e3,
        "background_s": math.fsum(total) / 1e3,
        "blocking_s": math.fsum(blocking) / 1e3,
    }


def throughput_effect(
    w: WorkerRecord, snapshots: Sequence[Event], segments: Sequence[Segment]
) -> dict[str, Any] | None:
    """Steps per second of one worker between consecutive snapshots (their ``step``), split by whether the interval
    lies wholly in a useful or wholly in a degraded segment; the two means and their difference with 95% CIs."""
    points = sorted(
        ((e.ts, s) for e in snapshots if e.worker_id == w.id and (s := number_of(e.data, "step")) is not None),
        key=lambda p: p[0],
    )
    rates: dict[str, list[float]] = {"useful": [], "degraded": []}
    for (t1, s1), (t2, s2) in itertools.pairwise(points):
        if t2 <= t1 or s2 < s1:
            continue
        seg = next((g for g in segments if g.start <= t1 and t2 <= g.end), None)
        if seg is not None and seg.phase in rates:
            rates[seg.phase].append((s2 - s1) / (t2 - t1))
    if not rates["useful"] and not rates["degraded"]:
        return None
    return {
        "worker": w.id,
        "metric": "steps_per_s",
        "useful": mean_ci(rates["useful"]).to_dict(),
        "degraded": mean_ci(rates["degraded"]).to_dict(),
        "degraded_minus_useful": diff_ci(rates["degraded"], rates["useful"]).to_dict(),
    }


def recovery_comparison(events: Iterable[Event]) -> dict[str, Any]:
    """``recovery`` events of a pool: device-hours each kind measured (``total_s`` x the group's devices), and for
    heals the device-hours a restart would have cost, estimated from the restarts measured in the same window
    (their mean ``total_s``)."""
    heals: list[tuple[float, int]] = []
    restarts: list[tuple[float, int]] = []
    for e in events:
        if e.type is not EventType.RECOVERY:
            continue
        total = number_of(e.data, "total_s")
        if total is None:
            continue
        devs = e.data.get("devices")
        n = len(devs) if isinstance(devs, Mapping) and devs else 1
        (heals if e.data.get("mode") == "heal" else restarts).append((total, n))
    restart_s = statistics.fmean(t for t, _ in restarts) if restarts else None
    out: dict[str, Any] = {
        "restarts": len(restarts),
        "restart_device_hours": sum(t * n for t, n in restarts) / 3600,
        "heals": len(heals),
        "heal_device_hours": sum(t * n for t, n in heals) / 3600,
        "restart_s_mean": restart_s,
        "heal_as_restart_device_hours_estimate": None,
        "saved_device_hours_estimate": None,
    }
    if heals and restart_s is not None:
        est = sum(restart_s * n for _, n in heals) / 3600
        out["heal_as_restart_device_hours_estimate"] = est
        out["saved_device_hours_estimate"] = est - out["heal_device_hours"]
    return out


def retired_records(events: Sequence[Event], known: set[str], pool: str | None) -> list[WorkerRecord]:
    """Workers whose rows retention removed, rebuilt from their ``registered`` events (their device and metrics are
    gone: both are left unknown)."""
    out = []
    for e in events:
        if e.type is EventType.REGISTERED and e.worker_id and e.worker_id not in known and e.pool:
            if pool is not None and e.pool != pool:
                continue
            group = e.data.get("group")
            out.append(
                WorkerRecord(
                    e.worker_id,
                    e.pool,
                    group if isinstance(group, str) else "default",
                    e.ts,
                    devices=None,
                    progressed=None,
                )
            )
    return out


#: A worker's segments given the times other workers took over its device (``tally`` asks once per worker).
SegmentsOf = Callable[[WorkerRecord, Sequence[float]], Sequence[Segment]]


def account(
    workers: Sequence[WorkerRecord],
    events: Sequence[Event],
    window: Window,
    price_per_device_hour: float = 0.0,
    process: ProcessUsage | None = None,
    now: float | None = None,
) -> CostReport:
    """The cost report for ``workers`` over ``window`` from ``events`` (the state events of their whole lives,
    ``recovery`` events among them, and the window's ``snapshot`` events). Every worker's phase seconds add up to its
    allocated seconds in the window, so each pool's (and the report's) phases add up to its total."""
    by_worker, by_pool = _events_by_worker_and_pool(events, window)
    return tally(
        workers,
        lambda w, handovers: worker_segments(w, by_worker.get(w.id, ()), window, handovers, now),
        by_pool,
        window,
        price_per_device_hour,
        process,
    )


def tally(
    workers: Sequence[WorkerRecord],
    segments_of: SegmentsOf,
    by_pool: Mapping[str, Sequence[Event]],
    window: Window,
    price_per_device_hour: float = 0.0,
    process: ProcessUsage | None = None,
    overheads: Mapping[str, dict[str, Any]] | None = None,
    throughput: bool = True,
) -> CostReport:
    """The report from each worker's segments (``segments_of``) and each pool's ``snapshot`` and ``recovery`` events
    within the window (``by_pool``, in event order): what ``account`` computes once it has grouped its events, and
    what ``dsec.cost.ledger`` computes from the segments it keeps between reports. ``overheads``: each pool's
    ``snapshot_overhead``, when the caller has it already (then ``by_pool`` needs its snapshots only for the
    throughput effects). ``throughput=False`` leaves the per-worker throughput effects out (the gauges show none of
    them; at 10,000 workers they are most of a report's time), and says so in the notes."""
    registrations: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for w in workers:
        if w.device is not None:
            registrations[w.device].append((w.registered_at, w.id))
    snapshots_of = _snapshots_by_worker(by_pool) if throughput else {}
    pools: dict[str, PoolCost] = {}
    no_device: list[str] = []
    unknown_progress: list[str] = []
    step_estimates = 0
    for w in pacing.paced(workers):  # the control plane's gauges refresh runs this on a thread that gives way
        handovers = [t for t, other in registrations.get(w.device or "", ()) if other != w.id and t > w.registered_at]
        segs = segments_of(w, handovers)
        if not segs:
            continue
        pc = pools.setdefault(w.pool, PoolCost(w.pool))
        gc = pc.groups.setdefault(w.group, GroupCost())
        pc.workers += 1
        gc.workers += 1
        if w.devices is None:
            no_device.append(w.id)
        if w.progressed is None:
            unknown_progress.append(w.id)
        step_estimates += _add_hours(pc, gc, w, segs)
        if throughput:
            effect = throughput_effect(w, snapshots_of.get((w.pool, w.id), ()), segs)
            if effect is not None:
                pc.throughput.append(effect)
    for name, evs in by_pool.items():
        pc = pools.setdefault(name, PoolCost(name))
        pc.snapshots = snapshot_overhead(evs) if overheads is None else {}
        pc.recoveries = recovery_comparison(evs)
    for name, overhead in (overheads or {}).items():
        pools.setdefault(name, PoolCost(name)).snapshots = overhead
    for pc in pools.values():
        pc.snapshots = pc.snapshots or snapshot_overhead(())
        pc.recoveries = pc.recoveries or recovery_comparison(())
    estimated = _estimated(no_device, unknown_progress, step_estimates, pools)
    notes = [PROBE_OVERHEAD_NOTE, METRIC_HISTORY_NOTE]
    if not throughput:
        notes.append(NO_THROUGHPUT_NOTE)
    return CostReport(window, price_per_device_hour, pools, process, estimated, notes)


def _snapshots_by_worker(by_pool: Mapping[str, Sequence[Event]]) -> dict[tuple[str, str], list[Event]]:
    """Each (pool, worker)'s ``snapshot`` events, grouped once: ``throughput_effect`` read the whole pool's for every
    worker before (workers x snapshots per report: ~10^9 at 10,000 workers snapshotting every few minutes)."""
    out: dict[tuple[str, str], list[Event]] = defaultdict(list)
    for pool, evs in by_pool.items():
        for e in evs:
            if e.type is EventType.SNAPSHOT and e.worker_id is not None:
                out[(pool, e.worker_id)].append(e)
    return out


def _events_by_worker_and_pool(
    events: Sequence[Event], window: Window
) -> tuple[dict[str, list[Event]], dict[str, list[Event]]]:
    """Each worker's events (its state events and the ``recovery`` events that name it) and each pool's
    ``snapshot`` and ``recovery`` events within ``window``."""
    by_worker: dict[str, list[Event]] = defaultdict(list)
    by_pool: dict[str, list[Event]] = defaultdict(list)
    for e in events:
        if e.type is EventType.RECOVERY:
            named = e.data.get("worker")
            if isinstance(named, str):
                by_worker[named].append(e)
            if e.pool and window.since <= e.ts < window.until:
                by_pool[e.pool].append(e)
        elif e.type is EventType.SNAPSHOT:
            if e.pool and window.since <= e.ts < window.until:
                by_pool[e.pool].append(e)
        elif e.worker_id is not None:
            by_worker[e.worker_id].append(e)
    return by_worker, by_pool


def _add_hours(pc: PoolCost, gc: GroupCost, w: WorkerRecord, segs: Sequence[Segment]) -> int:
    """The worker's device-hours per phase into its pool and group; 1 when its degraded time was also turned into
    degraded steps by its step time (an estimate), else 0."""
    devices = w.devices if w.devices is not None else 1
    degraded_s = 0.0
    for s in segs:
        pc.hours.add(s.phase, s.seconds * devices / 3600)
        gc.hours.add(s.phase, s.seconds * devices / 3600)
        if s.phase == "degraded":
            degraded_s += s.seconds
    if degraded_s > 0 and w.step_ms:
        pc.degraded_steps = (pc.degraded_steps or 0.0) + degraded_s / (w.step_ms / 1e3)
        return 1
    return 0


def _estimated(
    no_device: list[str], unknown_progress: list[str], step_estimates: int, pools: dict[str, PoolCost]
) -> list[str]:
    """What the report estimates rather than measures, one line each."""
    estimated: list[str] = []
    if no_device:
        estimated.append(f"devices: {len(no_device)} worker(s) registered without a device, 1 device each assumed")
    if unknown_progress:
        estimated.append(f"progress: {len(unknown_progress)} retired worker(s) without metrics, counted as training")
    if step_estimates:
        estimated.append(
            f"degraded_steps: degraded seconds / the worker's latest step_ms_mean ({step_estimates} worker(s))"
        )
    if any(p.recoveries.get("heal_as_restart_device_hours_estimate") is not None for p in pools.values()):
        estimated.append("recoveries: a heal's cost as a restart, from the mean total_s of the window's restarts")
    return estimated
