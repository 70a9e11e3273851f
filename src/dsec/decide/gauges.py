"""The gauges policies read, per pool and per worker: one computation for the Prometheus collector, the control
plane's policy sampler and the simulator, so a rule, a dashboard and a simulation see the same numbers."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from dsec.decide.views import WorkerView
from dsec.model import WorkerState
from dsec.quota import PoolMemory

Key = tuple[str, str, "str | None"]  # (metric, pool, worker) as dsec.policy.series keys them


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
    # The breaker's latency signal (``caps.sample_from``: sync cost p50, else sync latency p50) and the latency cap in
    # force for the worker; NaN when unknown. Exposed on /metrics only (not policy samples).
    sync_latency_ms: float = math.nan
    latency_cap_ms: float = math.nan


def utilization(ratios: Sequence[float]) -> float:
    """Mean of the active workers' used/quota memory ratios (0 without any)."""
    return sum(ratios) / len(ratios) if ratios else 0.0


def sync_success(ok: float, ops: float) -> float:
    return ok / ops if ops > 0 else math.nan


def pool_recovery_s(reports: Mapping[str, float], active_workers: int, min_reporters: int) -> float:
    """A pool's recovery time from its workers' latest reported restore times: their lower median, once at least
    ``min_reporters`` distinct workers reported (or every active worker of a smaller pool); NaN before.

    Workers report it, and policies change the whole pool on it: one worker (a bug, or a token in the wrong hands)
    must not move it. The lower median cannot be raised by any minority of reporters."""
    values = sorted(reports.values())
    if not values or len(values) < max(1, min(min_reporters, active_workers)):
        return math.nan
    return values[(len(values) - 1) // 2]


def pool_gauges_of(
    workers: Sequence[WorkerView],
    pending: int,
    meltdowns: float,
    restore_reports: Mapping[str, float],
    min_reporters: int,
    memory: PoolMemory | None,
) -> PoolGauges:
    """One pool's gauges from its workers (every state) and what the control plane counts for it."""
    active = [w for w in workers if w.state is WorkerState.ACTIVE]
    ratios = [
        w.metrics["memory_used_gb"] / w.fields.memory_quota_gb
        for w in active
        if "memory_used_gb" in w.metrics and w.fields.memory_quota_gb
    ]
    g = PoolGauges(
        utilization=utilization(ratios),
        sync_success=sync_success(
            sum(w.metrics.get("sync_ok_total", 0.0) for w in workers),
            sum(w.metrics.get("sync_ops_total", 0.0) for w in workers),
        ),
        recovery_s=pool_recovery_s(restore_reports, len(active), min_reporters),
        meltdowns=float(meltdowns),
        workers={s: sum(1 for w in workers if w.state is s) for s in WorkerState},
        pending=pending,
    )
    if memory is not None:
        for kind, value in (("capacity", memory.capacity_gb), ("granted", memory.granted_gb), ("used", memory.used_gb)):
            if value is not None:
                g.memory[kind] = float(value)
    return g


def policy_samples(pools: Mapping[str, PoolGauges], workers: Iterable[WorkerGauges] = ()) -> dict[Key, float]:
    """The gauges as policy samples keyed (metric, pool, worker). A gauge without a value (NaN: no sync yet, too
    few restore reports) is no sample: a rule's window holds only real values."""
    out: dict[Key, float] = {}
    for pool, g in pools.items():
        out[("dsec_sandbox_utilization_rate", pool, None)] = g.utilization
        out[("dsec_gradient_sync_success_rate", pool, None)] = g.sync_success
        out[("dsec_snapshot_recovery_time", pool, None)] = g.recovery_s
        out[("dsec_melt_down_count", pool, None)] = g.meltdowns
        out[("dsec_directives_pending", pool, None)] = float(g.pending)
        out[("dsec_workers_active", pool, None)] = float(g.workers.get(WorkerState.ACTIVE, 0))
        out[("dsec_workers_lost", pool, None)] = float(g.workers.get(WorkerState.LOST, 0))
        if "used" in g.memory:
            out[("dsec_pool_memory_used_gb", pool, None)] = g.memory["used"]
        if "granted" in g.memory:
            out[("dsec_pool_memory_granted_gb", pool, None)] = g.memory["granted"]
    for wg in workers:
        if wg.active:
            out[("dsec_worker_melt_down_count", wg.pool, wg.worker)] = wg.meltdowns
            out[("dsec_breaker_level", wg.pool, wg.worker)] = wg.level
    return {k: v for k, v in out.items() if not math.isnan(v)}
