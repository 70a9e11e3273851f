"""Snapshot cadence from failure history: how often a pool's learners should save their state.

A periodic snapshot pays its cost ``C`` every interval ``T`` and, at a failure that rolls the learner back, saves
half an interval of work on average; Young's interval ``sqrt(2 C M)`` minimises the sum for a mean time between such
failures ``M`` (Daly's higher-order terms change it little while C << M). Which failures count: only those that
roll a learner back to its last snapshot — a failed actor restarts alone and a healed rank takes a peer's live state
(nothing rolls back), and a planned move (power-off, migration off a degraded device) snapshots just before. So with
per-worker restarts and healing, ``M`` is long and a fixed 90 s cadence pays for protection it rarely uses.

``M`` is estimated from the history: the group-seconds trained (the exposure) over the rollbacks seen, with the
configured interval as the prior — one pseudo-failure after the ``M0`` for which the configured interval is Young's
(``M0 = T0^2 / 2C``), the Gamma-Poisson estimate ``M = (exposure + M0) / (rollbacks + 1)``. So a pool with no
history snapshots at its configured interval; the interval lengthens while nothing rolls back and shortens with
each rollback. Bounds keep the interval between the snapshot writer's limit and a cap on what one unforeseen
failure can cost.

Used by the probe (``snapshots: {cadence: failure_history}`` in a job file: the supervisor hands each group's history
to its processes, each measures its snapshots' cost; probe/cadence.py) and by the simulator
(``dsec.snapshot_cadence: failure_history``), per group. Opt-in: ``fixed`` stays the default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def young_interval_s(cost_s: float, mtbf_s: float) -> float:
    """Young's optimal interval ``sqrt(2 C M)`` between saves costing ``cost_s`` for failures ``mtbf_s`` apart."""
    return math.sqrt(2.0 * max(cost_s, 0.0) * max(mtbf_s, 0.0))


@dataclass(frozen=True)
class CadenceConfig:
    floor_s: float = 30.0  # never more often (unless the configured interval is shorter: then not below it)
    ceiling_s: float = 1800.0  # never less often: a bound on the work one unforeseen failure can cost


def snapshot_interval_s(
    cost_s: float,
    exposure_s: float,
    rollbacks: int,
    prior_interval_s: float,
    config: CadenceConfig = CadenceConfig(),
) -> float:
    """The interval for snapshots costing ``cost_s`` (training time per snapshot) after ``exposure_s`` group-seconds
    of training with ``rollbacks`` failures that rolled a learner back; ``prior_interval_s``: the configured interval,
    what a pool without history gets."""
    floor = min(config.floor_s, prior_interval_s)  # an operator who asked for 5 s gets no less than 5 s
    if cost_s <= 0:
        return floor  # free snapshots: as often as allowed
    prior_mtbf = prior_interval_s**2 / (2.0 * cost_s)
    mtbf = (exposure_s + prior_mtbf) / (rollbacks + 1)
    return min(max(config.ceiling_s, prior_interval_s), max(floor, young_interval_s(cost_s, mtbf)))
