"""What a simulation run leaves behind: its interruptions and the outcome of one regime (:mod:`dsec.sim.engine`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Interruption:
    t: float
    group: int
    cause: str  # crash | oom | power | migration
    workers: int  # workers whose process ended
    recovery_s: float  # from the failure to training again (restart; without time spent waiting for capacity)
    rolled_back_steps: float
    learners: int = 0  # of the workers, learners (a failure without one need not roll back: actors hold no state)

    def to_dict(self) -> dict[str, Any]:
        return {
            "t": round(self.t, 1),
            "group": self.group,
            "cause": self.cause,
            "workers": self.workers,
            "recovery_s": round(self.recovery_s, 3),
            "rolled_back_steps": round(self.rolled_back_steps, 2),
            "learners": self.learners,
        }


@dataclass
class Outcome:
    """What one regime did with the scenario; see :func:`summarize` for the derived figures."""

    regime: str
    duration_s: float
    groups: int
    workers: int
    gpus_per_group: float
    ideal_rate: float  # fault-free useful steps/s of one group
    progress: np.ndarray  # useful steps per group
    down_s: np.ndarray  # restarting
    pending_s: np.ndarray  # waiting for capacity
    blocked_s: np.ndarray  # checkpoint / snapshot cost
    rolled_back: np.ndarray  # useful steps lost to failures
    sync_ops: float
    sync_ok: float
    interruptions: list[Interruption]
    meltdowns: int | None
    timeline: list[tuple[float, float]]  # (t, total useful steps)
    decisions: dict[str, int] = field(default_factory=dict)  # what the regime's control did, by kind
    wall_s: float = 0.0
    peak_rss_mb: float = 0.0
