"""A learner's snapshot interval from its group's failure history (``snapshots: {cadence: failure_history}``).

The supervisor knows the group's history — the seconds it has trained and the restarts that rolled it back to its
snapshots (a failed actor restarting alone, a heal and a move off a degraded device roll nothing back) — and hands
it to each process it starts (``DSEC_SNAPSHOT_HISTORY=exposure_s:rollbacks``); the process adds its own running
time and measures what its snapshots cost. ``dsec.decide.cadence`` turns that into Young's interval, the configured
interval being the prior: before the first snapshot is measured, the configured interval applies. The job's other
groups' history (``DSEC_SNAPSHOT_JOB_HISTORY``: the supervisor's file, dsec.job_history) sharpens that prior: a
job of 8 calm groups lengthens every group's interval 8x sooner than each would alone.

The cost of a snapshot is taken as its whole wall time (``total_ms``: the blocking copy plus the background
quantize/compress/write), an upper bound on what it takes from training where the background work shares the
CPU with it; on a GPU learner the background part overlaps the device's work, so the interval comes out longer
than optimal (by at most the square root of the overestimate).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from dsec import job_history

log = logging.getLogger(__name__)

FAILURE_HISTORY = "failure_history"


class SnapshotCadence:
    def __init__(
        self,
        exposure_s: float,
        rollbacks: int,
        clock: Callable[[], float] = time.monotonic,
        job_history: Path | None = None,
        group: str = "",
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.exposure_s = exposure_s
        self.rollbacks = rollbacks
        self._clock = clock
        self._t0 = clock()
        # The job's other groups, from the supervisor's history file (dsec.job_history), re-read every REFRESH_S.
        self._job_history = job_history
        self._group = group
        self._wall = wall
        self._peers: tuple[float, int] = (0.0, 0)
        self._peers_read_at = -math.inf
        self._costs: deque[float] = deque(maxlen=8)  # the last snapshots' cost, seconds (the writer's thread only)
        # Their (upper) median, set once per snapshot: the training thread reads it at every step (one float, read
        # whole), instead of sorting the costs under a lock each time.
        self._cost: float | None = None
        # Imported here, when the option is on, not at the top: dsec.decide loads the decision cores (numpy and ~140
        # modules), which a training process that did not ask for this cadence must not pay for. Not lazily at the
        # first interval either: that import ran mid-training, on the training thread or the snapshot writer's.
        from dsec.decide.cadence import snapshot_interval_s

        self._rule = snapshot_interval_s

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> SnapshotCadence | None:
        """From ``DSEC_SNAPSHOT_CADENCE`` (``fixed``, the default without a job file, or ``failure_history``),
        ``DSEC_SNAPSHOT_HISTORY`` (the group's own) and ``DSEC_SNAPSHOT_JOB_HISTORY`` (the supervisor's file, for the
        other groups of ``DSEC_GROUP``'s job); an invalid value is logged and the configured interval applies."""
        mode = (env.get("DSEC_SNAPSHOT_CADENCE") or "fixed").strip()
        if mode == "fixed":
            return None
        if mode != FAILURE_HISTORY:
            log.error("dsec: DSEC_SNAPSHOT_CADENCE=%r is invalid (expected fixed or %s); fixed", mode, FAILURE_HISTORY)
            return None
        raw = env.get("DSEC_SNAPSHOT_HISTORY") or "0:0"
        try:
            exposure, rollbacks = raw.split(":")
            history = (float(exposure), int(rollbacks))
            if not (history[0] >= 0 and history[1] >= 0):
                raise ValueError("negative")
        except ValueError:
            log.error("dsec: DSEC_SNAPSHOT_HISTORY=%r is invalid (expected EXPOSURE_S:ROLLBACKS); no history", raw)
            history = (0.0, 0)
        path = env.get("DSEC_SNAPSHOT_JOB_HISTORY") or None
        return cls(*history, job_history=Path(path) if path else None, group=env.get("DSEC_GROUP") or "")

    def observe(self, snapshot: Mapping[str, Any]) -> None:
        """A snapshot this process took (its ``snapshot`` event's data)."""
        total_ms = snapshot.get("total_ms")
        if isinstance(total_ms, (int, float)) and not isinstance(total_ms, bool) and total_ms >= 0:
            self._costs.append(float(total_ms) / 1e3)
            costs = sorted(self._costs)
            self._cost = costs[len(costs) // 2]  # the (upper) median: one slow write does not set it

    def cost_s(self) -> float | None:
        return self._cost

    def interval(self, configured_s: float | None) -> float | None:
        """The interval for now: ``configured_s`` (the job's or the directive's) until a snapshot's cost is known."""
        cost = self.cost_s()
        if configured_s is None or cost is None:
            return configured_s
        exposure = self.exposure_s + (self._clock() - self._t0)
        return self._rule(cost, exposure, self.rollbacks, configured_s, peers=self.peers())

    def peers(self) -> tuple[float, int]:
        """The job's other groups' (exposure_s, rollbacks), as last read (none without a readable file)."""
        if self._job_history is None:
            return self._peers
        now = self._wall()
        if now - self._peers_read_at >= job_history.REFRESH_S:
            self._peers_read_at = now
            read = job_history.peers_of(self._job_history, self._group, now)
            self._peers = read if read is not None else (0.0, 0)
        return self._peers
