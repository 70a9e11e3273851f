"""Drain before the cap: a process whose memory climbs into an allocator limit that will not move is restarted from a
snapshot taken for it, instead of dying of the out-of-memory error a few seconds later.

Why: a quota's ceiling stops a slow climb (a leak, a cache that keeps growing) so that it fails alone instead of
filling its card under its neighbours (dsec.quota.elastic, "Grant and limit"). Measured on real processes
(benchmarks/chaos_memory.py), that turned one leaker into more OOMs than no quotas at all: it reached its ceiling
sooner than it would have filled the card, and every OOM lost the work since the last periodic snapshot plus the time
to notice the death. The restart a climb like that needs cannot be avoided — the memory is not coming back — but its
cost can: the probe sees the climb and the limit, so it snapshots at the last step that fits and then stops the process
(the supervisor restarts it from that snapshot, as after any exit; its peers restore the same step).

Rule, at each optimizer step of the training code: the held memory's least-squares slope over the last
``window_s`` (at least ``min_samples`` readings spanning ``min_span_s``) is positive but slower than a burst
(``dsec.quota.trend.BURST_RAMP_GB_PER_S``, the control plane's own line between the two), at that slope the process
would pass its allocator limit within ``horizon_s``, and that limit is final: it is at the worker's ceiling (its
directive's ``memory_ceiling_gb``), where the control plane stops a slow climb. A burst is left alone: the control
plane runs its limit past the ceiling into the card's free memory (a burst ends; a stop would cost a restart it may
not need). A limit below the ceiling is left alone too: the next quota plan grows it by the climb's ramp. No allocator
cap in force (no quota, or an allocator nobody caps) or no snapshots: nothing to do, the process runs into whatever it
runs into, as before.

``DSEC_MEMORY_RECYCLE_HORIZON_S`` sets ``horizon_s`` (default 2; 0 turns the rule off).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dsec.probe.memory import growth_gb_per_h
from dsec.quota.trend import drainable


class MemoryRecycle(BaseException):
    """Raised into the training code at an optimizer step after the recycle snapshot was written: the process ends
    (it derives from BaseException so that a training loop's ``except Exception`` does not swallow it)."""


@dataclass
class ClimbWatch:
    horizon_s: float = 2.0
    window_s: float = 10.0
    min_samples: int = 3
    min_span_s: float = 1.0
    #: Readings closer than this are one reading (optimizer steps come hundreds a second; memory moves slower).
    every_s: float = 0.25
    _samples: deque[tuple[float, float]] = field(default_factory=deque)
    _slope: float | None = None

    def observe(self, now: float, held_gb: float) -> None:
        if self._samples and now - self._samples[-1][0] < self.every_s:
            if held_gb > self._samples[-1][1]:
                self._samples[-1] = (self._samples[-1][0], held_gb)  # keep the highest reading of the interval
                self._slope = self._fit()
            return
        self._samples.append((now, held_gb))
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        self._slope = self._fit()

    def _fit(self) -> float | None:
        growth = growth_gb_per_h(self._samples, self.min_samples, self.min_span_s)
        return None if growth is None else growth / 3600.0

    def slope_gb_per_s(self) -> float | None:
        return self._slope

    def due(self, limit_gb: float | None, ceiling_gb: float | None) -> bool:
        """Whether the climb reaches a final ``limit_gb`` within the horizon (see the module docstring)."""
        if self.horizon_s <= 0 or limit_gb is None or not self._samples:
            return False
        slope = self.slope_gb_per_s()
        # No ceiling known: the limit is all there is (final).
        if slope is None or not drainable(limit_gb, limit_gb if ceiling_gb is None else ceiling_gb, slope):
            return False
        held = self._samples[-1][1]
        return held + slope * self.horizon_s > limit_gb
