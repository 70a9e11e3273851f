"""Periodic per-worker directive changes: elastic memory quotas of a pool, and precision restores."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from dsec.decide.caps import finite
from dsec.decide.verdicts import Change
from dsec.decide.views import WorkerView
from dsec.health.interventions import PrecisionGuard
from dsec.model import Event, EventType, Pool
from dsec.quota import MemoryTrend, PoolMemory, QuotaConfig, WorkerMemory, plan
from dsec.quota.trend import PEAK_HOLD_S, observe_arrays


@dataclass
class QuotaVerdict:
    accounting: PoolMemory
    changes: list[Change] = field(default_factory=list)


def observe_memory(
    trends: Mapping[str, MemoryTrend], workers: Sequence[WorkerView], now: float
) -> dict[str, MemoryTrend]:
    """Each reporting worker's memory trend after its latest ``memory_used_gb`` (the planner's ramp and recent
    peak); workers that are gone are dropped.

    The same as ``old.observe(used, now)`` per worker (tests/unit/decide/test_decide.py checks it), computed for
    every worker in one numpy call: per worker, numpy's scalar operations cost ~50 us, which at 10,000 workers made
    this a third of the control plane's reconcile pass."""
    out: dict[str, MemoryTrend | None] = {}
    ids: list[str] = []
    olds: list[MemoryTrend] = []
    readings: list[float] = []
    for w in workers:
        used = finite(w.metrics, "memory_used_gb")
        old = trends.get(w.id)
        if used is None:
            if old is not None:
                out[w.id] = old
        elif old is None:
            out[w.id] = MemoryTrend.first(used, now)
        else:
            out[w.id] = None  # its place in the order; filled below
            ids.append(w.id)
            olds.append(old)
            readings.append(used)
    if olds:
        columns = np.array([(o.t, o.used_gb, o.ramp_gb_per_s, o.peak_gb, o.peak_t, o.burst_t) for o in olds]).T
        t, used_gb, ramp, peak, peak_t, burst_t = columns
        after = observe_arrays(t, used_gb, ramp, peak, peak_t, np.array(readings), now, PEAK_HOLD_S, burst_t)
        rows = zip(*(np.asarray(a, dtype=float).tolist() for a in after), strict=True)
        for wid, values in zip(ids, rows, strict=True):
            out[wid] = MemoryTrend(*values)
    return {wid: trend for wid, trend in out.items() if trend is not None}


def plan_pool_quotas(
    pool: Pool,
    capacity_gb: float | None,
    workers: Sequence[WorkerView],
    config: QuotaConfig,
    now: float,
    trends: Mapping[str, MemoryTrend] | None = None,
    device_gb: float | None = None,
) -> QuotaVerdict:
    """Grow/reclaim the memory grants of ``pool``'s active ``workers`` within ``capacity_gb`` (the memory of the
    devices they share) and issue their allocator limits (``device_gb``: one device's memory); one ``quota``
    event per worker whose grant or limit changes, with the pool's accounting after it. ``trends``: each worker's
    memory trend (:func:`observe_memory`) for growth by ramp and idle reclaim; None: neither."""
    trends = trends or {}
    members = []
    for w in workers:
        trend = trends.get(w.id)
        members.append(
            WorkerMemory(
                w.id,
                finite(w.metrics, "memory_used_gb"),
                w.fields.memory_quota_gb or pool.memory_base_gb,
                w.fields.memory_ceiling_gb,
                ramp_gb_per_s=trend.ramp_gb_per_s if trend else 0.0,
                recent_peak_gb=trend.peak_gb if trend else None,
                limit_gb=w.fields.memory_limit_gb,
                bursting=trend.bursting(now) if trend else False,
            )
        )
    result = plan(capacity_gb, pool.memory_base_gb, pool.memory_ceiling_gb, members, config, device_gb=device_gb)
    verdict = QuotaVerdict(result.accounting)
    by_id = {w.id: w for w in workers}
    for wid in sorted(set(result.changes) | set(result.limit_changes)):
        patch: dict[str, float | None] = {}
        fields = by_id[wid].fields
        data: dict[str, object] = {"kind": "memory_quota", "from_gb": fields.memory_quota_gb}
        if wid in result.changes:
            patch["memory_quota_gb"] = result.changes[wid]
        data["to_gb"] = patch.get("memory_quota_gb", fields.memory_quota_gb)
        if wid in result.limit_changes:
            patch["memory_limit_gb"] = result.limit_changes[wid]
            data["limit_from_gb"] = fields.memory_limit_gb
            data["limit_to_gb"] = result.limit_changes[wid]
        data["reason"] = result.reasons.get(wid, "")
        data["pool_memory"] = result.accounting.to_dict()
        ev = Event(ts=now, type=EventType.QUOTA, worker_id=wid, pool=pool.name, data=data)
        verdict.changes.append(Change(wid, patch, "quota", [ev]))
    return verdict


def precision_restore(w: WorkerView, guard: PrecisionGuard, now: float) -> Change | None:
    """The precision a fallback replaced, once ``guard`` has seen it stable for long enough."""
    if guard.original is None:
        return None
    decision = guard.revert(w.fields.precision, now)
    if decision is None:
        return None
    patch, data = decision
    ev = Event(ts=now, type=EventType.RECOVERED, worker_id=w.id, pool=w.pool, data=data)
    return Change(w.id, patch, "precision_fallback", [ev])
