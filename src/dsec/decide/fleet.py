"""Fleet judgment of one pool: who is an outlier among its peers (robust median/MAD per role), who could be judged
on speed at all, and whether the whole pool's sync is slow (the network or backend, not one worker)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dsec import pacing
from dsec.alerts.model import Severity
from dsec.decide.caps import latency_signal, safe_latency_floor
from dsec.decide.pause import learner_step_ms
from dsec.decide.verdicts import alert_event
from dsec.decide.views import WorkerView
from dsec.health.fleet import FleetConfig, FleetReport, Outlier, PeerSample, compare
from dsec.model import Event, EventType, Pool
from dsec.scheduler.device_health import SLOW_FEATURES


@dataclass
class FleetVerdict:
    events: list[Event] = field(default_factory=list)
    flags: dict[str, set[str]] = field(default_factory=dict)  # worker -> features it is an outlier on now
    judged: set[str] = field(default_factory=set)  # workers whose speed could be compared with peers
    slow_pool: bool = False  # most peers over the pool's latency cap at once
    latency_floor_ms: float | None = None  # cap safety: the latency cap in force is at least this (decide.caps)
    # For the ladder's top rung (decide.pause): the pool's active actors, and its learners' median step time (the
    # step an actor's lateness holds up; an actor that steps no optimizer reports none of its own).
    actors: int = 0
    learner_step_ms: float | None = None


def judged_workers(samples: Sequence[PeerSample], report: FleetReport, config: FleetConfig) -> set[str]:
    """Workers of a role that had at least ``min_peers`` peers reporting a speed feature: the only ones the
    comparison can call slow (a single learner cannot be), so the only ones that count for device health."""
    speed_roles = {st.role for st in report.stats if st.feature in SLOW_FEATURES and st.n >= config.min_peers}
    return {s.worker_id for s in samples if s.role in speed_roles}


def slow_workers(outliers: Mapping[str, Sequence[Outlier]] | Mapping[str, set[str]]) -> set[str]:
    """Workers flagged on a speed feature (step time, sync lag)."""
    out = set()
    for wid, flagged in outliers.items():
        names = {o if isinstance(o, str) else o.feature for o in flagged}
        if names & set(SLOW_FEATURES):
            out.add(wid)
    return out


def judge_pool(
    pool: Pool | None,
    pool_name: str,
    workers: Sequence[WorkerView],
    previous: Mapping[str, set[str]],
    was_slow: bool,
    config: FleetConfig,
    now: float,
    margin: float = 0.2,
) -> FleetVerdict:
    """Compare the active ``workers`` of one pool; events for new and cleared outliers (``previous``: each
    worker's flags before) and for the pool's sync slowdown starting (``was_slow``: it was already reported)."""
    # A view's metrics are immutable: the comparison reads them in place (``PeerSample.value`` takes only finite
    # numbers, not bools) instead of a copy of the compared names per worker.
    samples = [PeerSample(w.id, w.role, w.group, w.metrics) for w in pacing.paced(workers) if w.metrics]
    report = compare(samples, config)
    flagged = report.outliers_by_worker()
    verdict = FleetVerdict(
        judged=judged_workers(samples, report, config),
        actors=sum(1 for w in workers if w.role == "actor"),
        learner_step_ms=learner_step_ms(workers),
    )
    for w in pacing.paced(workers):  # paced checks before its first worker too
        before = previous.get(w.id, set())
        if not before and w.id not in flagged:  # the common case: nothing flagged before or now
            verdict.flags[w.id] = set()
            continue
        now_flags = {o.feature: o for o in flagged.get(w.id, [])}
        for feature in sorted(set(now_flags) - before):
            verdict.events += _outlier_events(w, now_flags[feature], len(samples), now)
        for feature in sorted(before - set(now_flags)):
            data = {"kind": "fleet_outlier_cleared", "feature": feature}
            verdict.events.append(Event(ts=now, type=EventType.ANOMALY, worker_id=w.id, pool=w.pool, data=data))
        verdict.flags[w.id] = set(now_flags)
    if pool is not None:
        costs = [latency_signal(w.metrics) for w in pacing.paced(workers)]
        verdict.slow_pool, alert = _pool_slowdown(pool, costs, was_slow, config, now)
        verdict.events += alert
        verdict.latency_floor_ms = safe_latency_floor(costs, pool.thresholds.latency_cap_ms, config.min_peers, margin)
    return verdict


def _outlier_events(w: WorkerView, o: Outlier, peers: int, now: float) -> list[Event]:
    data = {
        "kind": "fleet_outlier",
        "feature": o.feature,
        "value": o.value,
        "median": o.median,
        "mad": o.mad,
        "z": o.z if math.isfinite(o.z) else None,
        "peers": peers,
    }
    summary = f"{o.feature}={o.value:.4g} vs fleet median {o.median:.4g}"
    return [
        Event(ts=now, type=EventType.ANOMALY, worker_id=w.id, pool=w.pool, data=data),
        alert_event(now, f"{w.agent}_straggler_{o.feature}", Severity.WARNING, summary, data, w.id, w.pool),
    ]


def _pool_slowdown(
    pool: Pool, costs: Sequence[float | None], was_slow: bool, config: FleetConfig, now: float
) -> tuple[bool, list[Event]]:
    """Every peer over the latency cap at once is the pool's network or backend, not one bad worker: one
    pool-level alert (and the cap in force is lifted above the pool's median: ``safe_latency_floor``)."""
    values = sorted(c for c in costs if c is not None)
    cap = pool.thresholds.latency_cap_ms
    slow = len(values) >= config.min_peers and values[len(values) // 2] > cap
    if not slow or was_slow:
        return slow, []
    median = values[len(values) // 2]
    summary = (
        f"median sync cost {median:.1f} ms over the pool's cap {cap:g} ms "
        f"on {sum(1 for v in values if v > cap)}/{len(values)} workers"
    )
    data = {"median_ms": median, "cap_ms": cap, "workers": len(values)}
    return slow, [alert_event(now, f"{pool.name}_pool_sync_slowdown", Severity.WARNING, summary, data, pool=pool.name)]
