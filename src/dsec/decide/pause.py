"""Whether the ladder's top rung — pausing an actor's sampling — pays: a pure rule shared by the control plane and the
simulator.

At the rung below (4-bit gradients with accumulation x``accum``) a late actor holds its group up by its sync cost
once every ``accum`` steps. Pausing it ends that wait, and takes its samples away. What an actor's samples are worth
was measured on a real actor-learner job (benchmarks/calibrate_paused.py, docs/benchmarks.md "What a paused actor
costs"; 10 seeds): with 1 of 4 actors paused the job progressed at 0.739 of its rate, with 2 of 4 at 0.432 — at or
below the share of samples left, since with fewer actors the remaining samples also taught less per sample. So the
top rung is taken only when the wait it ends costs more per step than the progress it gives up:

    sync cost per step  =  cost_ms / accum   >   (1 - progress_left((actors - 1) / actors)) x step_ms

With the example scenario's 15 actors per learner and 0.6 s steps that is a lateness over ~167 ms per sync at
accumulation x4; with 4 actors, over ~626 ms. Unknown inputs leave the ladder as it was (the rung allowed).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from dsec.decide.views import WorkerView

#: (share of a job's actors sampling, share of its progress left), measured; (0, 0) and (1, 1) join the ends.
SAMPLING_PROGRESS: tuple[tuple[float, float], ...] = ((0.5, 0.432), (0.75, 0.739))


def curve_points(curve: Sequence[tuple[float, float]] = SAMPLING_PROGRESS) -> tuple[list[float], list[float]]:
    """``curve``'s shares and progress with (0, 0) and (1, 1) at the ends: ``numpy.interp``'s ``xp`` and ``fp`` (the
    simulator reads its world's curve through this too, ``dsec.sim.scenario.Efficiency.sampling_curve``)."""
    pts = [(0.0, 0.0), *curve, (1.0, 1.0)]
    return [x for x, _ in pts], [y for _, y in pts]


def progress_left(share: float, curve: Sequence[tuple[float, float]] = SAMPLING_PROGRESS) -> float:
    """The share of its progress a job keeps with ``share`` of its actors sampling: linear between the measured
    points of ``curve``, with (0, 0) and (1, 1) at the ends (a share outside 0..1 reads as the nearer end)."""
    return float(np.interp(share, *curve_points(curve)))


def pause_pays(
    cost_ms: float | None,
    accum: float,
    step_ms: float | None,
    actors: int,
    curve: Sequence[tuple[float, float]] = SAMPLING_PROGRESS,
) -> bool:
    """Whether pausing one more of a group's ``actors`` costs less than the lateness it causes: ``cost_ms`` per sync
    (the breaker's latency signal: the lateness the group suffered because of this worker), one sync every
    ``accum`` steps of ``step_ms``. True when the cost, the step time or the number of actors is unknown."""
    if cost_ms is None or step_ms is None or actors < 1 or not (math.isfinite(cost_ms) and math.isfinite(step_ms)):
        return True
    loss = 1.0 - progress_left((actors - 1) / actors, curve)
    return max(0.0, cost_ms) / max(1.0, accum) > loss * max(0.0, step_ms)


def learner_step_ms(workers: Iterable[WorkerView]) -> float | None:
    """The median ``step_ms_mean`` of the learners among ``workers`` (a pool's active workers): the step an actor's
    lateness holds up. None when no learner reports one."""
    steps = []
    for w in workers:
        v = w.metrics.get("step_ms_mean") if w.role == "learner" else None
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
            steps.append(float(v))
    return statistics.median(steps) if steps else None
