"""The per-pool and per-worker gauge values, computed from the hot state.

One computation for two readers: the Prometheus collector (at scrape time) and the policy engine's sampler
(on its own interval), so a rule and a dashboard always see the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dsec.model import WorkerState

if TYPE_CHECKING:
    from dsec.control.service import ControlPlane
    from dsec.control.state import LiveWorker


@dataclass
class PoolGauges:
    utilization: float
    sync_success: float
    recovery_s: float
    meltdowns: float
    workers: dict[WorkerState, int]
    pending: int
    memory: dict[str, float] = field(default_factory=dict)  # capacity / granted / used


@dataclass
class WorkerGauges:
    pool: str
    worker: str
    role: str
    active: bool
    meltdowns: float
    level: float


def pool_recovery_s(reports: Mapping[str, float], active_workers: int, min_reporters: int) -> float:
    """A pool's recovery time from its workers' latest reported restore times: their lower median, once at least
    ``min_reporters`` distinct workers reported (or every active worker of a smaller pool); NaN before.

    Workers report it, and policies change the whole pool on it: one worker (a bug, or a token in the wrong hands)
    must not move it. The lower median cannot be raised by any minority of reporters."""
    values = sorted(reports.values())
    if not values or len(values) < max(1, min(min_reporters, active_workers)):
        return math.nan
    return values[(len(values) - 1) // 2]


def pool_gauges(cp: ControlPlane) -> dict[str, PoolGauges]:
    st = cp.state
    by_pool: dict[str, list[LiveWorker]] = {name: [] for name in st.pools}
    for w in list(st.workers.values()):
        by_pool.setdefault(w.pool, []).append(w)
    out: dict[str, PoolGauges] = {}
    for pool, ws in sorted(by_pool.items()):
        active = [w for w in ws if w.state is WorkerState.ACTIVE]
        ratios = [
            w.metrics["memory_used_gb"] / w.directive.fields.memory_quota_gb
            for w in active
            if "memory_used_gb" in w.metrics and w.directive.fields.memory_quota_gb
        ]
        ops = sum(w.metrics.get("sync_ops_total", 0.0) for w in ws)
        ok = sum(w.metrics.get("sync_ok_total", 0.0) for w in ws)
        g = PoolGauges(
            utilization=sum(ratios) / len(ratios) if ratios else 0.0,
            sync_success=ok / ops if ops > 0 else math.nan,
            recovery_s=pool_recovery_s(
                st.restore_reports.get(pool, {}), len(active), cp.settings.restore_min_reporters
            ),
            meltdowns=float(st.meltdowns.get(pool, 0)),
            workers={s: sum(1 for w in ws if w.state is s) for s in WorkerState},
            pending=sum(1 for w in active if w.acked_version != w.directive.version),
        )
        mem = cp.judge.pool_memory.get(pool)
        if mem is not None:
            for kind, value in (("capacity", mem.capacity_gb), ("granted", mem.granted_gb), ("used", mem.used_gb)):
                if value is not None:
                    g.memory[kind] = float(value)
        out[pool] = g
    return out


def worker_gauges(cp: ControlPlane) -> list[WorkerGauges]:
    st = cp.state
    out = []
    for w in list(st.workers.values()):
        b = cp.judge.breakers.get(w.id)
        out.append(
            WorkerGauges(
                pool=w.pool,
                worker=w.id,
                role=w.info.role.value,
                active=w.state is WorkerState.ACTIVE,
                meltdowns=float(st.worker_meltdowns.get(w.id, 0)),
                level=float(b.level if b else 0),
            )
        )
    return out
