"""Liveness decisions: pure functions of (workers, now)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from dsec.model import WorkerState


class Beating(Protocol):
    """What liveness reads of a worker: a :class:`Beat`, or the control plane's live worker itself (reading it in
    place spares building 10,000 values every pass: 20 -> 4 ms per pass at 10,000 workers, measured here)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def state(self) -> WorkerState: ...
    @property
    def last_beat_at(self) -> float: ...
    @property
    def interval_s(self) -> float: ...


@dataclass(frozen=True)
class Beat:
    worker_id: str
    state: WorkerState
    last_beat_at: float
    interval_s: float


def overdue(beats: Iterable[Beating], now: float, lost_after_beats: int) -> list[str]:
    """Ids of active workers that missed ``lost_after_beats`` beats of their own interval (``scan``'s first half)."""
    return scan(beats, now, lost_after_beats)[0]


def scan(beats: Iterable[Beating], now: float, lost_after_beats: int) -> tuple[list[str], float]:
    """The ids of active workers that missed ``lost_after_beats`` beats of their own interval (in input order), and the
    earliest deadline among the active workers (inf: none active): the time before which none of them can be
    overdue, since a beat only moves a worker's deadline later. A caller that knows when workers become active (the
    reconcile pass, through ``HotState.quiet_until``) need not look again before then: a pass over 10,000 workers
    costs ~5 ms, four times a second."""
    late: list[str] = []
    first = math.inf
    active = WorkerState.ACTIVE
    for b in beats:
        if b.state is active:
            window = lost_after_beats * b.interval_s
            if now - b.last_beat_at > window:
                late.append(b.worker_id)
            due = b.last_beat_at + window
            if due < first:
                first = due
    return late, first
