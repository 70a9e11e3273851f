"""Degraded-device detection and probation: a pure state machine over (what each device's workers look like, now).

A device whose workers are *all* fleet outliers on compute speed (``SLOW_FEATURES``) for ``degrade_after_s``
(all that could be judged: a worker without peers to compare with neither counts for nor against) becomes
*degraded*: nothing new is placed on it and the caller snapshots its workers and moves them. "All" matters: one slow
worker is that worker's problem (the breaker's business); every worker of a device slow at once points at
the device. A degraded device left empty for ``probation_after_s`` goes on *probation* (placeable, last in line);
once a worker has run on it unflagged for ``probation_s`` it is *healthy* again; flagged again on probation, it is
degraded again at once (it already had its chance).

The control plane (control/scheduling.py) and the cluster simulator (sim/) both drive this class; it holds only the
timers, the caller owns the devices and applies the changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from dsec.model import DeviceHealth

# Fleet features (health/fleet.py) that say "this worker computes slowly", the evidence against its device: the
# optimizer step's time and the compute time between steps. Not the sync features: sync latency grows with the
# link (a jittery or rate-limited network follows the worker, not the card — the simulator migrated in a loop on
# it, and on a real rate-limited link 2 of 3 healthy devices were found degraded), and a rank's lag at sync is
# its compute plus its data and host stalls, which compute_ms_p50 already holds without the network. They still
# make fleet outlier events.
SLOW_FEATURES = ("step_ms_mean", "compute_ms_p50")


@dataclass(frozen=True)
class DeviceHealthConfig:
    degrade_after_s: float = 3.0  # every worker on the device flagged this long -> degraded
    probation_after_s: float = 60.0  # degraded and empty this long -> probation
    probation_s: float = 60.0  # a worker ran this long on a probation device unflagged -> healthy
    recovery_hold_s: float = 120.0  # policy actions on the pool are held back this long after a degradation


@dataclass(frozen=True)
class Occupancy:
    """What a device's workers look like now: how many it runs, how many of them the fleet comparison could judge
    (a role with fewer than ``min_peers`` workers — the single learner of an IMPALA-style group — is not compared),
    and how many of those it flagged slow."""

    workers: int
    judged: int
    slow: int

    @property
    def all_slow(self) -> bool:
        """Every judged worker is slow, and there was at least one: an unjudged worker does not veto the device."""
        return self.judged > 0 and self.slow >= self.judged


@dataclass(frozen=True)
class HealthChange:
    device: str
    before: DeviceHealth
    after: DeviceHealth
    why: str

    @property
    def degraded(self) -> bool:
        return self.after is DeviceHealth.DEGRADED


class DeviceHealthTracker:
    def __init__(self, config: DeviceHealthConfig | None = None) -> None:
        self.config = config or DeviceHealthConfig()
        self._flagged_since: dict[str, float] = {}  # device -> when all its workers were first seen flagged
        self._since: dict[str, float] = {}  # device -> when it entered its current non-healthy state
        self._clean_since: dict[str, float] = {}  # probation device -> since when it ran a worker unflagged

    def step(
        self, now: float, health: Mapping[str, DeviceHealth], occupancy: Mapping[str, Occupancy]
    ) -> list[HealthChange]:
        """The health changes due at ``now``; ``health`` is every device's current health, ``occupancy`` the
        devices that run workers (absent: empty). The caller applies the changes; the timers assume it does."""
        changes: list[HealthChange] = []
        for dev, current in health.items():
            occ = occupancy.get(dev)
            has_workers = occ is not None and occ.workers > 0
            slow = occ is not None and occ.all_slow
            change: HealthChange | None = None
            if current is DeviceHealth.HEALTHY:
                if not slow:
                    self._flagged_since.pop(dev, None)
                    continue
                first = self._flagged_since.setdefault(dev, now)
                if now - first >= self.config.degrade_after_s:
                    change = HealthChange(dev, current, DeviceHealth.DEGRADED, "its workers are fleet outliers")
            elif current is DeviceHealth.DEGRADED:
                # setdefault: a device found degraded without a timer (the caller restarted) starts its wait now.
                if not has_workers and now - self._since.setdefault(dev, now) >= self.config.probation_after_s:
                    change = HealthChange(dev, current, DeviceHealth.PROBATION, "empty and quiet since it degraded")
            elif current is DeviceHealth.PROBATION:
                if slow:
                    change = HealthChange(dev, current, DeviceHealth.DEGRADED, "its workers are fleet outliers")
                elif has_workers:
                    clean = self._clean_since.setdefault(dev, now)
                    if now - clean >= self.config.probation_s:
                        change = HealthChange(dev, current, DeviceHealth.HEALTHY, "ran a worker through probation")
                else:
                    self._clean_since.pop(dev, None)
            if change is not None:
                self.entered(dev, now)
                changes.append(change)
        return changes

    def entered(self, device: str, now: float) -> None:
        """``device`` changed health at ``now`` (by :meth:`step` or by an operator): its timers start over."""
        self._since[device] = now
        self._flagged_since.pop(device, None)
        self._clean_since.pop(device, None)
