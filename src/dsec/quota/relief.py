"""Memory relief: gradient accumulation for a worker whose burst is about to overflow its card.

A design study (issue 17): the simulator runs it when a scenario sets ``dsec.memory_relief``; **the control plane does
not issue it yet** (it would be a ``grad_accum_steps`` directive from the quota loop, merged with the breaker's: the
larger wins). Why: most OOMs left under elastic quotas are bursts that fill a card while the card's other workers
hold their memory (docs/benchmarks.md); a limit cannot prevent those, only less memory can, and a rollout under
gradient accumulation uses less — *if* the training code shrinks its micro-batch when accumulation rises: the
probe's accumulation alone keeps the batch per backward pass, so for zero-touch training this assumption fails. With
the measured accumulation cost (0.48 per sample) the study trades fewer OOMs for slightly less progress on rl-128
(docs/benchmarks.md, re-run 2026-12-03); not shipped.

Rule, per card, at each plan: the card's projected usage is the sum over its workers of ``used + ramp x horizon_s``.
When it exceeds the card's memory, the steepest-ramping worker that is not accumulating already (for any reason) is
relieved — one per card per plan: the next plan sees what that changed. A relieved worker is released once its burst
hold is over (:func:`dsec.quota.trend.bursting`) and its ramp is zero. Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: The accumulation a relieved worker runs at: the breaker's accumulation rung (dsec.breaker ladder).
RELIEF_ACCUM_STEPS = 4


@dataclass(frozen=True)
class CardWorker:
    worker_id: str
    used_gb: float
    ramp_gb_per_s: float
    accumulating: bool  # accumulating gradients now, for any reason (the breaker, or relief)
    relieved: bool  # accumulating because of relief
    bursting: bool  # in a burst or its hold (MemoryTrend.bursting)


@dataclass(frozen=True)
class Relief:
    relieve: tuple[str, ...] = ()
    release: tuple[str, ...] = ()


def relief(capacity_gb: float, workers: Sequence[CardWorker], horizon_s: float) -> Relief:
    """Whom to relieve and whom to release on one card of ``capacity_gb`` (see the module docstring)."""
    projected = sum(w.used_gb + w.ramp_gb_per_s * horizon_s for w in workers)
    relieve: tuple[str, ...] = ()
    if projected > capacity_gb:
        candidates = [w for w in workers if not w.accumulating and w.ramp_gb_per_s > 0]
        if candidates:
            steepest = max(candidates, key=lambda w: (w.ramp_gb_per_s, w.worker_id))
            relieve = (steepest.worker_id,)
    release = tuple(w.worker_id for w in workers if w.relieved and not w.bursting and w.ramp_gb_per_s == 0)
    return Relief(relieve, release)
