"""Prometheus exposition with a registry owned by the app (no global default registry).

The per-pool gauges are computed at scrape time from the hot state (a custom collector), so the
heartbeat path does no metric work beyond one counter increment.

Naming: the four headline names are fixed by the product (dashboards and policies refer to them).
``dsec_melt_down_count`` is exposed as a gauge that only grows, because a Prometheus counter's samples
must be named ``*_total``; ``promtool check metrics`` reports that one "_count suffix" lint and nothing
else (see docs/protocol.md). ``dsec_snapshot_recovery_time`` is in seconds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from dsec.control.ports import GaugeSource
    from dsec.cost import CostReport


class PoolCollector(Collector):
    """dsec_* gauges per pool, derived from workers' reported metrics and recorded events."""

    def __init__(self, gauges: GaugeSource) -> None:
        self._gauges = gauges

    def collect(self) -> Iterator[Metric]:
        util, sync, recovery, melt, workers, pending, memory = _pool_families()
        worker_melt, level, sync_latency, latency_cap = _worker_families()
        for pool, g in self._gauges.pool_gauges().items():
            util.add_metric([pool], g.utilization)
            sync.add_metric([pool], g.sync_success)
            recovery.add_metric([pool], g.recovery_s)
            melt.add_metric([pool], g.meltdowns)
            for s, n in g.workers.items():
                workers.add_metric([pool, s.value], float(n))
            pending.add_metric([pool], float(g.pending))
            for kind, value in g.memory.items():
                memory.add_metric([pool, kind], value)
        for wg in self._gauges.worker_gauges():
            if wg.meltdowns:
                worker_melt.add_metric([wg.pool, wg.worker], wg.meltdowns)
            if wg.active:
                level.add_metric([wg.pool, wg.worker], wg.level)
                if not math.isnan(wg.sync_latency_ms):
                    sync_latency.add_metric([wg.pool, wg.worker], wg.sync_latency_ms / 1000.0)
                if not math.isnan(wg.latency_cap_ms):
                    latency_cap.add_metric([wg.pool, wg.worker], wg.latency_cap_ms / 1000.0)
        yield from (util, sync, recovery, melt, workers, pending, worker_melt, level, sync_latency, latency_cap, memory)


def _pool_families() -> tuple[GaugeMetricFamily, ...]:
    """The per-pool families, empty: utilization, sync success, recovery time, meltdowns, workers by state,
    pending directives, memory accounting."""
    util = GaugeMetricFamily(
        "dsec_sandbox_utilization_rate",
        "Mean over a pool's active workers of memory used / memory quota (0..1+); 0 without reports.",
        labels=["pool"],
    )
    sync = GaugeMetricFamily(
        "dsec_gradient_sync_success_rate",
        "Share of gradient-sync operations that completed within the latency cap without error, "
        "from workers' cumulative sync_ok_total / sync_ops_total; NaN before any sync.",
        labels=["pool"],
    )
    recovery = GaugeMetricFamily(
        "dsec_snapshot_recovery_time",
        "Seconds the most recent snapshot restore in the pool took; NaN before any restore.",
        labels=["pool"],
    )
    melt = GaugeMetricFamily(
        "dsec_melt_down_count",
        "Entries into degradation (breaker meltdowns) in the pool since the store was created; only grows.",
        labels=["pool"],
    )
    workers = GaugeMetricFamily("dsec_workers", "Registered workers by pool and state.", labels=["pool", "state"])
    pending = GaugeMetricFamily(
        "dsec_directives_pending",
        "Active workers whose desired directive version is not acked yet.",
        labels=["pool"],
    )
    memory = GaugeMetricFamily(
        "dsec_pool_memory_gb",
        "Pool memory accounting of the elastic quotas: device capacity, quota granted, memory used.",
        labels=["pool", "kind"],
    )
    return util, sync, recovery, melt, workers, pending, memory


def _worker_families() -> tuple[GaugeMetricFamily, ...]:
    """The per-worker families, empty: meltdowns, breaker level, sync latency, latency cap."""
    worker_melt = GaugeMetricFamily(
        "dsec_worker_melt_down_count",
        "Entries into degradation per worker since the store was created; only grows.",
        labels=["pool", "worker"],
    )
    level = GaugeMetricFamily(
        "dsec_breaker_level",
        "Degradation level in force per active worker (0 healthy .. 3 sampling paused).",
        labels=["pool", "worker"],
    )
    sync_latency = GaugeMetricFamily(
        "dsec_worker_sync_latency_seconds",
        "The breaker's latency signal per active worker: its sync cost p50 (lateness it caused the group), else "
        "its sync latency p50, in seconds; absent before the worker reported a sync.",
        labels=["pool", "worker"],
    )
    latency_cap = GaugeMetricFamily(
        "dsec_worker_latency_cap_seconds",
        "Latency cap in force per active worker, in seconds (its own override, else its pool's threshold).",
        labels=["pool", "worker"],
    )
    return worker_melt, level, sync_latency, latency_cap


class CostCollector(Collector):
    """dsec_cost_* gauges per pool from the last hour's cost report (recomputed every ``cost_refresh_s`` by the
    reconcile loop, never at scrape time: a scrape reads no store). Labels: pool, and phase (4 values)."""

    def __init__(self, last: Callable[[], CostReport | None]) -> None:
        self._last = last

    def collect(self) -> Iterator[Metric]:
        hours = GaugeMetricFamily(
            "dsec_cost_device_seconds",
            "Device-seconds allocated in the pool over the last hour (device-hours x 3600), by phase: useful, "
            "degraded, recovering, idle.",
            labels=["pool", "phase"],
        )
        snap_bytes = GaugeMetricFamily(
            "dsec_cost_snapshot_bytes", "Snapshot bytes written in the pool over the last hour.", labels=["pool"]
        )
        snap_s = GaugeMetricFamily(
            "dsec_cost_snapshot_background_seconds",
            "Background time of the pool's snapshots over the last hour (their total_ms), in seconds.",
            labels=["pool"],
        )
        report = self._last()
        for pool, pc in sorted((report.pools if report is not None else {}).items()):
            for phase, value in pc.hours.to_dict().items():
                if phase != "total":
                    hours.add_metric([pool, phase], value * 3600)
            snap_bytes.add_metric([pool], float(pc.snapshots.get("bytes", 0.0)))
            snap_s.add_metric([pool], float(pc.snapshots.get("background_s", 0.0)))
        yield from (hours, snap_bytes, snap_s)


class ControlPlaneMetrics:
    def __init__(self, gauges: GaugeSource, cost: Callable[[], CostReport | None] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        self.registry.register(PoolCollector(gauges))
        if cost is not None:
            self.registry.register(CostCollector(cost))
        self.requests = Counter(
            "dsec_http_requests_total",
            "HTTP requests by route template, method and status.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "dsec_http_request_duration_seconds",
            "HTTP request latency by route template.",
            ["route"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
            registry=self.registry,
        )
        self.heartbeats = Counter(
            "dsec_heartbeats_total", "Heartbeats applied, by pool.", ["pool"], registry=self.registry
        )
        self._heartbeats_by_pool: dict[str, Counter] = {}

    def heartbeat_counter(self, pool: str) -> Counter:
        """The pool's child of dsec_heartbeats_total, cached (the hot path calls this per beat)."""
        child = self._heartbeats_by_pool.get(pool)
        if child is None:
            child = self._heartbeats_by_pool[pool] = self.heartbeats.labels(pool)
        return child
