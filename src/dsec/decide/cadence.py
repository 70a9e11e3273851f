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

The job's other groups (``peers``: their exposure and rollbacks together) run the same code on the same kind of
devices, so their history says what one group's own cannot yet: their estimate, ``(peer exposure + M0) / (peer
rollbacks + 1)``, replaces ``M0`` as the group's prior — still one pseudo-failure's weight, so a group whose own
learner keeps failing shortens its interval against a calm job (partial pooling; with no peers, or none with
history, the rule is the single-group one above). A job of 8 groups learns in an hour what one group learns in 8.

Used by the probe (``snapshots: {cadence: failure_history}`` in a job file: the supervisor hands each group's history
to its processes, each measures its snapshots' cost; probe/cadence.py) and by the simulator
(``dsec.snapshot_cadence``), per group with the job's other groups as its prior. The default of job files and of
the simulator since 2026-12-04 (``cadence: fixed`` keeps a fixed interval).
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
    peers: tuple[float, int] = (0.0, 0),
) -> float:
    """The interval for snapshots costing ``cost_s`` (training time per snapshot) after ``exposure_s`` group-seconds
    of training with ``rollbacks`` failures that rolled a learner back; ``prior_interval_s``: the configured interval,
    what a pool without history gets; ``peers``: the job's other groups' exposure and rollbacks, summed."""
    floor = min(config.floor_s, prior_interval_s)  # an operator who asked for 5 s gets no less than 5 s
    if cost_s <= 0:
        return floor  # free snapshots: as often as allowed
    peer_exposure, peer_rollbacks = peers
    prior_mtbf = (max(peer_exposure, 0.0) + prior_interval_s**2 / (2.0 * cost_s)) / (max(peer_rollbacks, 0) + 1)
    mtbf = (exposure_s + prior_mtbf) / (rollbacks + 1)
    return min(max(config.ceiling_s, prior_interval_s), max(floor, young_interval_s(cost_s, mtbf)))
