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

A burst gets a snapshot instead (``ClimbWatch.burst_due``, ``dsec.quota.trend.burst_at_risk``): memory rising at a
burst's rate over the last ``burst_window_s`` that, at that rate, passes the allocator limit in force or the card's
free memory (whichever binds first) within ``horizon_s`` has the process snapshot at the end of this optimizer step
(a request like the control plane's ``snapshot_now``; in a DDP group the ranks agree on it in the next sync header),
once per burst and bound (a limit the control plane raised meanwhile is a new bound). The process runs on: the burst
may fit (its limit runs into the card's free memory). If it does not, the allocation fails as before and the restart
resumes from that snapshot instead of the last periodic one (which the snapshot cadence spaces by the failure
history: minutes apart when failures are rare). Measured in the simulator (rl-128, one day): a learner's OOM rolled
its group back 31-489 steps; with the snapshot, 7.

``DSEC_MEMORY_RECYCLE_HORIZON_S`` sets ``horizon_s`` for both (default 2; 0 turns both off). Both read the CUDA
device the training code uses (dsec.probe.device_memory: the caching allocator's reserved memory, the card's free
memory), or the fake card that stands in for one where no GPU is (dsec.probe.fake_card).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from dsec.probe.memory import growth_gb_per_h
from dsec.quota.trend import AT_CEILING_GB, BURST_RAMP_GB_PER_S, burst_at_risk, drainable


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
    #: A burst's slope is read over this much of the latest readings (the climb's window would lag a burst's start).
    burst_window_s: float = 2.0
    _samples: deque[tuple[float, float]] = field(default_factory=deque)
    _slope: float | None = None
    # The bound this burst (readings rising at a burst's rate since) was snapshotted for; None: not yet. A bound that
    # rose since (the control plane ran the limit past the ceiling) is a new risk: the snapshot is re-taken near it.
    _burst_bound: float | None = None

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

    def burst_slope_gb_per_s(self) -> float | None:
        """The rise over the readings of the last ``burst_window_s`` (None: fewer than two, or under half a second)."""
        if len(self._samples) < 2:
            return None
        t1, g1 = self._samples[-1]
        first = next(((t, g) for t, g in self._samples if t >= t1 - self.burst_window_s), None)
        if first is None or t1 - first[0] < 0.5:
            return None
        return (g1 - first[1]) / (t1 - first[0])

    def burst_due(self, limit_gb: float | None) -> bool:
        """Whether to snapshot now ahead of a burst's out-of-memory error (see the module docstring): rising at a
        burst's rate into ``limit_gb`` (what binds first: the allocator cap, the card's room) within the horizon,
        and not snapshotted yet in this burst for this bound. Once per burst and bound: a reading below the burst
        line ends the burst; a bound that rose is a new one (the snapshot for the old one is stale by then)."""
        slope = self.burst_slope_gb_per_s()
        if slope is None or slope < BURST_RAMP_GB_PER_S:
            self._burst_bound = None
            return False
        if self.horizon_s <= 0 or limit_gb is None:
            return False
        if self._burst_bound is not None and limit_gb <= self._burst_bound + AT_CEILING_GB:
            return False
        if not burst_at_risk(self._samples[-1][1], slope, limit_gb, self.horizon_s):
            return False
        self._burst_bound = limit_gb
        return True
