"""The limits a worker's breaker judges it against, and the breaker's signals from one beat's metrics."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from dsec.breaker import Caps, Sample
from dsec.model import DirectiveFields, PoolThresholds


def finite(metrics: Mapping[str, Any], key: str) -> float | None:
    """``metrics[key]`` as a float when it is a finite number (a bool is not a number here)."""
    v = metrics.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def caps_for(
    thresholds: PoolThresholds | None,
    pool_ceiling_gb: float | None,
    fields: DirectiveFields | None = None,
    memory_pressure: float = 1.0,
) -> Caps:
    """The caps in force: the worker's own directive overrides, else its pool's thresholds (which policies may
    change), else the defaults. The memory cap is the memory ceiling times ``memory_pressure`` (1.0 as shipped:
    the breaker's memory path acts at the ceiling)."""
    th = thresholds or PoolThresholds()
    ceiling = (fields.memory_ceiling_gb if fields else None) or pool_ceiling_gb
    return Caps(
        bandwidth_mbps=(fields.bandwidth_cap_mbps if fields else None) or th.bandwidth_cap_mbps,
        latency_ms=(fields.latency_cap_ms if fields else None) or th.latency_cap_ms,
        memory_gb=None if ceiling is None else ceiling * memory_pressure,
    )


def sample_from(metrics: Mapping[str, Any], ts: float) -> Sample:
    """The breaker's signals from one beat's metrics. Latency is the per-step *cost* (lateness the group
    suffered because of this rank, see probe/ddp.py); plain sync latency when the cost is unknown."""
    upload = finite(metrics, "grad_upload_bytes_per_s")
    latency = finite(metrics, "sync_cost_ms_p50")
    if latency is None:
        latency = finite(metrics, "sync_latency_ms_p50")
    return Sample(
        ts=ts,
        bandwidth_mbps=None if upload is None else upload / 1e6,
        latency_ms=latency,
        memory_gb=finite(metrics, "memory_used_gb"),
    )
