"""The limits a worker's breaker judges it against, and the breaker's signals from one beat's metrics."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from dsec.breaker import Caps, Sample
from dsec.model import DirectiveFields, PoolThresholds


def finite(metrics: Mapping[str, Any], key: str) -> float | None:
    """``metrics[key]`` as a float when it is a finite number (a bool is not a number here)."""
    v = metrics.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


#: When a whole pool cannot get under its latency cap, the cap in force is this much above the pool's median: above
#: 1 / (1 - margin) = 1.25 so a worker at the median is calm, with room for per-sync noise.
SAFE_CAP_HEADROOM = 1.5


def caps_for(
    thresholds: PoolThresholds | None,
    pool_ceiling_gb: float | None,
    fields: DirectiveFields | None = None,
    memory_pressure: float | None = None,
    latency_floor_ms: float | None = None,
) -> Caps:
    """The caps in force: the worker's own directive overrides, else its pool's thresholds (which policies may
    change), else the defaults. The memory cap is the memory ceiling times ``memory_pressure``; None (as shipped):
    the breaker does not judge memory. Its memory path answers with gradient accumulation, which frees memory only
    where the training code shrinks its micro-batch when ``grad_accum_steps`` rises; the probe's zero-touch
    accumulation keeps the micro-batch (docs/health.md, "The breaker's memory path"). ``latency_floor_ms`` (from
    :func:`safe_latency_floor`) lifts a latency cap the whole pool is over."""
    th = thresholds or PoolThresholds()
    ceiling = (fields.memory_ceiling_gb if fields else None) or pool_ceiling_gb
    latency = (fields.latency_cap_ms if fields else None) or th.latency_cap_ms
    return Caps(
        bandwidth_mbps=(fields.bandwidth_cap_mbps if fields else None) or th.bandwidth_cap_mbps,
        latency_ms=latency if latency_floor_ms is None else max(latency, latency_floor_ms),
        memory_gb=None if ceiling is None or memory_pressure is None else ceiling * memory_pressure,
    )


def safe_latency_floor(
    costs: Iterable[float | None], cap_ms: float, min_peers: int, margin: float = 0.2
) -> float | None:
    """Cap safety: no latency cap may hold a healthy pool in permanent meltdown. A worker steps down only when its
    samples are under ``cap x (1 - margin)`` (the breaker's hysteresis), so once the lower median of the pool's
    per-worker sync costs (at least ``min_peers`` reporting) is over that, most of the pool can never recover: the
    lateness is the pool's network or backend, which no worker's degradation fixes. The cap in force then becomes
    ``SAFE_CAP_HEADROOM`` x that median — a worker at the median is calm, one much slower than its peers is still
    degraded. None when the cap is safe. (One pool's row of :func:`safe_latency_floors`.)"""
    row = np.array([[math.nan if c is None else float(c) for c in costs]], dtype=float)
    floor = float(safe_latency_floors(row, np.array([float(cap_ms)]), min_peers, margin)[0])
    return None if math.isnan(floor) else floor


def safe_latency_floors(costs: np.ndarray, cap_ms: np.ndarray, min_peers: int, margin: float = 0.2) -> np.ndarray:
    """:func:`safe_latency_floor` for each row of ``costs`` (a pool's workers; NaN or infinite: not reporting)
    against its ``cap_ms``: the floor, NaN where the cap is safe (the simulator's thousands of groups at once). The
    lower median of a row's finite costs is the ``(n - 1) // 2``-th smallest."""
    finite = np.isfinite(costs)
    count = finite.sum(axis=1)
    ordered = np.sort(np.where(finite, costs, np.inf), axis=1)
    median = np.take_along_axis(ordered, np.maximum((count - 1) // 2, 0)[:, None], axis=1)[:, 0]
    unsafe = (count >= max(min_peers, 1)) & (median > cap_ms * (1.0 - margin))
    return np.where(unsafe, median * SAFE_CAP_HEADROOM, np.nan)


def latency_signal(metrics: Mapping[str, Any]) -> float | None:
    """The breaker's latency signal: the per-step *cost* (lateness the group suffered because of this rank, see
    probe/ddp.py); plain sync latency when the cost is unknown."""
    latency = finite(metrics, "sync_cost_ms_p50")
    return finite(metrics, "sync_latency_ms_p50") if latency is None else latency


def sample_from(metrics: Mapping[str, Any], ts: float) -> Sample:
    """The breaker's signals from one beat's metrics at ``ts`` (``sample_values``, as a ``Sample``)."""
    return Sample(ts=ts, **sample_values(metrics))


def sample_values(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The breaker's finite signals from one beat's metrics, by name (latency: ``latency_signal``): what
    ``Breaker.observe_values`` takes, and ``sample_from(metrics, ts).values()``. Every beat of every worker makes
    one; building a frozen ``Sample`` and reading it back cost ~0.7 µs of it."""
    out: dict[str, float] = {}
    upload = finite(metrics, "grad_upload_bytes_per_s")
    if upload is not None:
        out["bandwidth_mbps"] = upload / 1e6  # finite: a finite float divided by 1e6
    latency = latency_signal(metrics)
    if latency is not None:
        out["latency_ms"] = latency
    memory = finite(metrics, "memory_used_gb")
    if memory is not None:
        out["memory_gb"] = memory
    return out
