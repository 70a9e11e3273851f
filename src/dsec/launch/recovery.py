"""A recovery of a supervised worker group, timed in phases (supervisor.py): a restart of the group or of one worker
(``detect_s``, ``stop_s``, ``restart_s``, ``restore_s``, ``total_s``) or a heal in place (``detect_s``,
``reconfigure_s``, ``rejoin_s``, ``total_s``), as the ``recovery`` event records them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Recovery:
    group: str
    worker: str
    code: int | None
    reason: str  # exit | degraded-device | heal-timeout
    detected_at: float
    detect_s: float
    stopped_at: float = 0.0  # restart: the group is stopped; heal: the death is reported
    spawned_at: float = 0.0
    resumed_at: float | None = None  # restart: every rank restored; heal: the replacement admitted
    restore_s: float | None = None
    restored: list[str] = field(default_factory=list)
    devices: dict[str, str] = field(default_factory=dict)
    mode: str = "restart"  # restart (the group) | heal | worker (the dead process alone: restart_scope worker)
    run: str | None = None  # heal: the healing run
    reconfigured_at: float | None = None  # heal: the survivors' epoch without the dead rank formed
    epoch: int | None = None  # heal: the epoch that admitted the replacement
    without_epoch: int | None = None  # heal: the survivors' epoch without the dead rank (formed, members known)
    report: dict[str, Any] | None = None  # heal: the death report, until the control plane took it

    def timings(self) -> dict[str, Any]:
        if self.mode == "heal":
            return self._heal_timings()
        out: dict[str, Any] = {
            "group": self.group,
            "worker": self.worker,
            "exit_code": self.code,
            "reason": self.reason,
            "detect_s": round(self.detect_s, 4),
            "stop_s": round(self.stopped_at - self.detected_at, 4),
            "devices": self.devices,
        }
        if self.mode == "worker":
            out.update(mode="worker", healthy_ranks_restarted=0)
        if self.resumed_at is not None:
            out["restart_s"] = round(self.resumed_at - (self.restore_s or 0.0) - self.spawned_at, 4)
            out["restore_s"] = round(self.restore_s or 0.0, 4)
            out["total_s"] = round(self.resumed_at - self.detected_at + self.detect_s, 4)
            out["restored"] = self.restored
        return out

    def _heal_timings(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mode": "heal",
            "group": self.group,
            "worker": self.worker,
            "exit_code": self.code,
            "reason": self.reason,
            "run": self.run,
            "detect_s": round(self.detect_s, 4),
            "healthy_ranks_restarted": 0,
            "devices": self.devices,
        }
        if self.reconfigured_at is not None:
            out["reconfigure_s"] = round(max(0.0, self.reconfigured_at - self.stopped_at), 4)
        if self.resumed_at is not None:
            out["rejoin_s"] = round(max(0.0, self.resumed_at - self.spawned_at), 4)
            out["total_s"] = round(self.resumed_at - self.detected_at + self.detect_s, 4)
            out["epoch"] = self.epoch
        return out


def rank_rejoined(rec: Recovery, rank: int, state: dict[str, Any]) -> bool:
    """Whether the healing group's ``state`` (GET /v1/heal/{run}) shows ``rank``'s replacement admitted; notes the
    survivors' reconfiguration in ``rec`` on the way.

    Admitted: a stable epoch that has ``rank`` as a member *and* either admitted it (its plan's joiners) or comes
    after the survivors' epoch without it. ``rank`` among the members alone is not enough: a control plane restarted
    during healing rebuilds the group from the members' own views, which still list the dead rank, so the old
    incarnation's membership would read as the replacement's admission (it did, in a test run under load: the
    supervisor recorded a heal that never happened and the job stopped while the replacement waited)."""
    if state.get("phase") != "stable":
        return False
    members = state.get("members") or []
    epoch = int(state.get("epoch") or 0)
    if rank not in members:
        if members and rec.without_epoch is None:
            rec.reconfigured_at = float(state.get("formed_at") or time.time())
            rec.without_epoch = epoch
        return False
    joiners = (state.get("plan") or {}).get("joiners") or []
    return rank in joiners or (rec.without_epoch is not None and epoch > rec.without_epoch)
