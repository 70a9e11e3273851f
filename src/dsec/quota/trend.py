"""A worker's memory trend between quota plans: its ramp (GB/s) and its recent peak — the inputs that let the
planner grant ahead of a burst and give back a grant the burst no longer needs. Pure and immutable: the caller keeps
one per worker and replaces it with ``observe``'s result."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Smoothing of the ramp between observations (1 = the last interval only). Half keeps one noisy reading from
#: granting a burst that is not there, and still follows a real ramp within two plans.
RAMP_WEIGHT = 0.5
#: How long a peak counts as "recent": a grant sized for it is reclaimed once no usage this high was seen for
#: this long (a sparse-reward burst holds ~2 min; a minute of calm after it is not a new burst coming).
PEAK_HOLD_S = 60.0
#: A ramp at least this steep is a burst (a sparse-reward rollout: 0.2-0.5 GB/s), not a leak (a leaking card:
#: ~3 GB/h = 0.001 GB/s). Only a burst may run past the worker's ceiling into free memory: a leak is stopped there, so
#: it fails early and alone and placement learns the card (docs/health.md).
BURST_RAMP_GB_PER_S = 0.05
#: A burst builds, then holds (minutes): its room past the ceiling lasts this long after its last steep reading.
BURST_HOLD_S = 300.0
#: A smoothed ramp below this is none (3.6 MB/h, far below a leak worth noticing): smoothing halves a ramp at each
#: flat reading after a burst, so without a floor it would never reach 0 and every quota plan's inputs would keep
#: changing (the simulator plans again only the cards whose inputs changed; at 10,000 workers that was every card).
RAMP_FLOOR_GB_PER_S = 1e-6
#: Readings closer than this are not used for a ramp (two beats in one instant say nothing about a rate).
MIN_DT_S = 0.5


@dataclass(frozen=True)
class MemoryTrend:
    t: float
    used_gb: float
    ramp_gb_per_s: float = 0.0
    peak_gb: float = 0.0
    peak_t: float = -math.inf
    burst_t: float = -math.inf  # the last reading whose ramp was a burst's

    @classmethod
    def first(cls, used_gb: float, now: float) -> MemoryTrend:
        return cls(now, used_gb, 0.0, used_gb, now)

    def observe(self, used_gb: float, now: float, hold_s: float = PEAK_HOLD_S) -> MemoryTrend:
        """The trend after a new reading (see :func:`observe_arrays`, the one formula)."""
        out = observe_arrays(
            self.t, self.used_gb, self.ramp_gb_per_s, self.peak_gb, self.peak_t, used_gb, now, hold_s, self.burst_t
        )
        return MemoryTrend(*(float(x) for x in out))

    def bursting(self, now: float) -> bool:
        return bool(bursting(self.burst_t, now))


#: A limit within this of the ceiling is at the ceiling (limits move on a 1 GB grid; readings are floats).
AT_CEILING_GB = 1e-6


def drainable(limit_gb: Any, ceiling_gb: Any, slope_gb_per_s: Any) -> Any:
    """Whether a climb at ``slope_gb_per_s`` into ``limit_gb`` is one to drain before the cap (dsec.probe.recycle)
    rather than leave to the control plane: the limit is final — at the ceiling, where the control plane stops a
    slow climb (a lower one the next plan may grow) — and the climb rises slower than a burst. Scalars (the probe) or
    numpy arrays (the simulator's workers at once); a NaN limit or slope is not drainable."""
    return (limit_gb >= ceiling_gb - AT_CEILING_GB) & (slope_gb_per_s > 0) & (slope_gb_per_s < BURST_RAMP_GB_PER_S)


def burst_at_risk(used_gb: Any, slope_gb_per_s: Any, limit_gb: Any, horizon_s: float) -> Any:
    """Whether a burst is about to fail its allocation: memory rising at least as steeply as a burst and, at that
    slope, past ``limit_gb`` (the allocator cap in force) within ``horizon_s``. A burst is let run into free memory
    (a stop would cost a restart it may not need), so what is worth doing ahead of its out-of-memory error is a
    snapshot: if the burst then fails, the restart loses nothing (dsec.probe.recycle's burst snapshot; the simulator's
    ``dsec.burst_snapshots``). Scalars or numpy arrays; a NaN limit or slope is never at risk."""
    return (slope_gb_per_s >= BURST_RAMP_GB_PER_S) & (used_gb + slope_gb_per_s * horizon_s > limit_gb)


def bursting(burst_t: Any, now: float) -> Any:
    """Whether a worker is in a burst (or its hold) at ``now``; element-wise over arrays."""
    return np.asarray(now - np.asarray(burst_t, dtype=float)) <= BURST_HOLD_S


def observe_arrays(
    t: Any,
    used: Any,
    ramp: Any,
    peak: Any,
    peak_t: Any,
    new_used: Any,
    now: float,
    hold_s: float = PEAK_HOLD_S,
    burst_t: Any = -math.inf,
) -> tuple[Any, Any, Any, Any, Any, Any]:
    """(t, used, ramp, peak, peak_t, burst_t) after a reading ``new_used`` at ``now``, element-wise over numpy
    arrays (the simulator's workers) or scalars (MemoryTrend). Rates are growth only (>= 0): shrinking usage is the idle
    reclaim's business, through the peak; growth from 0 GB held is a start, no rate. A reading too close to the last one
    updates the peak, not the ramp."""
    dt = now - np.asarray(t, dtype=float)
    fresh = dt >= MIN_DT_S
    rate = np.maximum(0.0, (np.asarray(new_used, dtype=float) - used) / np.where(fresh, dt, 1.0))
    # Growth from nothing held is a process starting (its first allocations: model, optimizer, cache), not a burst:
    # counted as one, it let a new worker's limit run past the ceiling for the whole burst hold (a leak in its
    # first minutes was not stopped there; benchmarks/chaos_memory.py).
    rate = np.where(np.asarray(used, dtype=float) > 0, rate, 0.0)
    new_ramp = np.where(fresh, RAMP_WEIGHT * rate + (1 - RAMP_WEIGHT) * np.asarray(ramp, dtype=float), ramp)
    new_ramp = np.where(new_ramp < RAMP_FLOOR_GB_PER_S, 0.0, new_ramp)
    reset = (np.asarray(new_used) >= peak) | (fresh & (now - np.asarray(peak_t, dtype=float) > hold_s))
    return (
        np.where(fresh, now, t),
        np.where(fresh, new_used, used),
        new_ramp,
        np.where(reset, new_used, peak),
        np.where(reset, now, peak_t),
        np.where(fresh & (new_ramp >= BURST_RAMP_GB_PER_S), now, burst_t),
    )
