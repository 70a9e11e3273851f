"""Liveness decisions: pure functions of (workers, now)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dsec.model import WorkerState


@dataclass(frozen=True)
class Beat:
    worker_id: str
    state: WorkerState
    last_beat_at: float
    interval_s: float


def overdue(beats: Iterable[Beat], now: float, lost_after_beats: int) -> list[str]:
    """Ids of active workers that missed ``lost_after_beats`` beats of their own interval."""
    return [
        b.worker_id
        for b in beats
        if b.state is WorkerState.ACTIVE and now - b.last_beat_at > lost_after_beats * b.interval_s
    ]
