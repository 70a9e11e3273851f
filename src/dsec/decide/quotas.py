"""Periodic per-worker directive changes: elastic memory quotas of a pool, and precision restores."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from dsec.decide.caps import finite
from dsec.decide.verdicts import Change
from dsec.decide.views import WorkerView
from dsec.health.interventions import PrecisionGuard
from dsec.model import Event, EventType, Pool
from dsec.quota import PoolMemory, QuotaConfig, WorkerMemory, plan


@dataclass
class QuotaVerdict:
    accounting: PoolMemory
    changes: list[Change] = field(default_factory=list)


def plan_pool_quotas(
    pool: Pool, capacity_gb: float | None, workers: Sequence[WorkerView], config: QuotaConfig, now: float
) -> QuotaVerdict:
    """Grow/reclaim the memory quotas of ``pool``'s active ``workers`` within ``capacity_gb`` (the memory of the
    devices they share); one ``quota`` event per change, with the pool's accounting after it."""
    members = [
        WorkerMemory(
            w.id,
            finite(w.metrics, "memory_used_gb"),
            w.fields.memory_quota_gb or pool.memory_base_gb,
            w.fields.memory_ceiling_gb,
        )
        for w in workers
    ]
    result = plan(capacity_gb, pool.memory_base_gb, pool.memory_ceiling_gb, members, config)
    verdict = QuotaVerdict(result.accounting)
    by_id = {w.id: w for w in workers}
    for wid, quota in sorted(result.changes.items()):
        data = {
            "kind": "memory_quota",
            "from_gb": by_id[wid].fields.memory_quota_gb,
            "to_gb": quota,
            "reason": result.reasons.get(wid, ""),
            "pool_memory": result.accounting.to_dict(),
        }
        ev = Event(ts=now, type=EventType.QUOTA, worker_id=wid, pool=pool.name, data=data)
        verdict.changes.append(Change(wid, {"memory_quota_gb": quota}, "quota", [ev]))
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
