"""How :func:`dsec.quota.elastic.plan` moves grants: growth, idle reclaim and reclaim of an over-committed pool,
all on the grid ``base + k * step`` (the rules are in :mod:`dsec.quota.elastic`'s docstring). Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsec.quota.elastic import QuotaConfig, WorkerMemory

# Float tolerance for capacity comparisons and grid rounding (GB); far below any meaningful quota.
_EPS = 1e-9


def _grid_ceil(x: float, base: float, ceiling: float, step: float) -> float:
    """The smallest ``base + k * step`` >= x (k >= 0), capped at ``ceiling``."""
    if x <= base:
        return base
    k = math.ceil((x - base) / step - _EPS)
    return min(ceiling, base + k * step)


def _grow(
    workers: Sequence[WorkerMemory],
    quota: dict[str, float],
    notes: dict[str, list[str]],
    usable: float,
    tol: float,
    ceiling: float,
    config: QuotaConfig,
) -> None:
    """One step more for each worker near its quota, closest first, while the pool has room."""
    candidates: list[tuple[float, str, float, float, float]] = []
    for w in workers:
        q = quota[w.worker_id]
        own = ceiling if w.ceiling_gb is None else min(ceiling, w.ceiling_gb)
        # used > 0: a worker that uses nothing does not need more, even with a zero quota.
        if w.used_gb is None or w.used_gb <= 0 or q >= own:
            continue
        ahead = w.used_gb + w.ramp_gb_per_s * config.ramp_horizon_s
        if ahead >= config.grow_when_used_fraction * q:
            ratio = ahead / q if q > 0 else math.inf
            candidates.append((-ratio, w.worker_id, w.used_gb, own, ahead))
    granted = math.fsum(quota.values())
    for _, wid, used, own, ahead in sorted(candidates):
        old = quota[wid]
        need = ahead * (1 + config.slack_fraction) if ahead > old else old
        new = min(own, max(old + config.step_gb, _grid_ceil(need, old, math.inf, config.step_gb)))
        # A worker whose step does not fit is skipped; a smaller step (capped at the ceiling) may still.
        if granted + (new - old) <= usable + tol:
            quota[wid] = new
            granted += new - old
            notes[wid].append(
                f"grown {old:g} -> {new:g} GB: uses {used:g} GB (in {config.ramp_horizon_s:g} s at its ramp: "
                f"{ahead:.3g} GB) >= {config.grow_when_used_fraction:.0%} of its quota, pool has headroom"
            )


def _reclaim_idle(
    workers: tuple[WorkerMemory, ...],
    quota: dict[str, float],
    notes: dict[str, list[str]],
    base: float,
    ceiling: float,
    config: QuotaConfig,
) -> set[str]:
    """Give back grants a worker's recent peak leaves unused (see the module docstring); the workers reclaimed."""
    out: set[str] = set()
    for w in workers:
        q = quota[w.worker_id]
        if w.recent_peak_gb is None or w.used_gb is None or q <= base:
            continue
        peak = max(w.recent_peak_gb, w.used_gb)
        target = _grid_ceil(peak * (1 + config.slack_fraction) / config.grow_when_used_fraction, base, ceiling,
                            config.step_gb)  # fmt: skip
        if q - target >= config.step_gb - _EPS:
            quota[w.worker_id] = target
            out.add(w.worker_id)
            notes[w.worker_id].append(f"idle grant reclaimed {q:g} -> {target:g} GB: recent peak {peak:.3g} GB")
    return out


def _reclaim(
    workers: tuple[WorkerMemory, ...],
    quota: dict[str, float],
    notes: dict[str, list[str]],
    usable: float,
    tol: float,
    base: float,
    ceiling: float,
    config: QuotaConfig,
) -> None:
    """Take grants back until the pool fits: reporting workers first, largest unused grant first."""
    step = config.step_gb
    granted = math.fsum(quota.values())
    over_by = granted - usable
    reporting: list[tuple[float, str, float, float]] = []
    silent: list[tuple[float, str]] = []
    for w in workers:
        q = quota[w.worker_id]
        if q <= base:
            continue
        if w.used_gb is None:
            silent.append((-(q - base), w.worker_id))
            continue
        target = min(q, _grid_ceil(w.used_gb * (1 + config.slack_fraction), base, ceiling, step))
        if target < q:
            reporting.append((-(q - w.used_gb), w.worker_id, target, w.used_gb))
    for _, wid, target, used in sorted(reporting):
        if granted <= usable + tol:
            return
        old = quota[wid]
        quota[wid] = target
        granted -= old - target
        notes[wid].append(
            f"reclaimed {old:g} -> {target:g} GB: pool over-committed by {over_by:g} GB, uses {used:g} GB"
        )
    for _, wid in sorted(silent):
        if granted <= usable + tol:
            return
        old = quota[wid]
        need = granted - usable
        cut = min(old - base, math.ceil(need / step - _EPS) * step)
        new = max(base, old - cut)
        quota[wid] = new
        granted -= old - new
        notes[wid].append(f"reclaimed {old:g} -> {new:g} GB: pool over-committed by {over_by:g} GB, no usage report")
