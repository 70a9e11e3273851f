"""Inputs and consequences of degraded-device detection (the timers are ``dsec.scheduler.DeviceHealthTracker``)."""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Set
from dataclasses import dataclass

from dsec.scheduler.device_health import DeviceHealthConfig, Occupancy


def occupancy(
    placed: Iterable[tuple[str, Hashable]], judged: Set[Hashable], slow: Set[Hashable]
) -> dict[str, Occupancy]:
    """Per device, from ``(device, worker)`` pairs of the active workers on it: how many run there, how many the
    fleet comparison could judge, how many of those it found slow. A worker it could not judge (a role with too
    few peers) neither proves a device healthy nor degraded."""
    counts: dict[str, list[int]] = {}
    for device, worker in placed:
        c = counts.setdefault(device, [0, 0, 0])
        c[0] += 1
        if worker in judged:
            c[1] += 1
            c[2] += worker in slow
    return {d: Occupancy(n, j, s) for d, (n, j, s) in counts.items()}


@dataclass(frozen=True)
class DegradeVerdict:
    """A device was found degraded: its workers snapshot (so they can be moved from that state) and the
    pool's policy actions are held until ``hold_until`` (a recovering pool's gauges are not its normal ones)."""

    snapshot_request: str
    hold_until: float


def degrade(device: str, now: float, config: DeviceHealthConfig) -> DegradeVerdict:
    return DegradeVerdict(f"degraded-{device}-{int(now)}", now + config.recovery_hold_s)
