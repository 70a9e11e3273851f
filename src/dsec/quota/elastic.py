"""Elastic memory quotas for the workers of one pool: a pure planner, called with the pool's numbers.

Semantics
---------
- Guarantee: every worker of a pool is granted at least ``base_gb`` (``Pool.memory_base_gb``), always,
  even when the pool's devices cannot hold ``workers * base``: the base is what a worker was admitted
  with, and taking it away would break a running job. An over-committed base shows as negative
  ``headroom_gb`` in the accounting, for the scheduler to act on (move or refuse workers), not here.
- Growth: a worker that uses at least ``grow_when_used_fraction`` of its quota is granted one more
  ``step_gb`` per plan, up to ``ceiling_gb`` (``Pool.memory_ceiling_gb``), while the pool has headroom:
  ``granted + step <= capacity - reserve``. When headroom is scarce, the workers closest to their
  quota (highest used/quota) are served first, ties by worker id, so plans are deterministic. One step
  per plan makes growth a ramp that follows demand, not a jump to the ceiling.
- Reclaim: only when the pool is over-committed (``granted > capacity - reserve``: a device was
  drained, a worker joined at base). Workers above base give back grants, largest unused grant
  (quota - used) first, down to ``max(base, used * (1 + slack))`` rounded up to the step grid, until
  the pool fits or nothing more can be taken. Never below base, never below what a worker uses plus
  slack. Growth and reclaim never happen in the same plan, and growth never over-commits, so with
  constant usage repeated plans reach a fixed point (no grow/reclaim oscillation).
- Over ceiling: a worker whose usage exceeds ``ceiling_gb`` is reported in ``over_ceiling``. The
  planner never kills anything; the caller routes such a worker through the breaker's
  memory-pressure path and raises an alert.
- No device information: ``capacity_gb`` None, or 0 (what ``Device.memory_gb`` reports when the memory
  is unknown), means the pool's capacity is unknown. Then quotas are only clamped to [base, ceiling]:
  no growth beyond what was granted (it could over-commit real devices) and no reclaim (there is
  nothing to fit into).
- No usage report (``used_gb`` None): the worker is not grown (no evidence it needs more) and keeps
  its quota, except when the pool is over-committed and the workers that do report cannot give back
  enough; then it gives back just what is needed to fit, largest grant first, never below base.

Quotas move on a grid ``base + k * step`` (capped at the ceiling), so growth and reclaim land on the
same values. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# Float tolerance for capacity comparisons and grid rounding (GB); far below any meaningful quota.
_EPS = 1e-9


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_nonneg(name: str, value: object, context: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value!r}{context} is invalid: expected a finite number >= 0")


@dataclass(frozen=True)
class WorkerMemory:
    """One worker's current quota and its last reported usage (None: no report yet)."""

    worker_id: str
    used_gb: float | None
    quota_gb: float
    # The worker's own ceiling when lower than the pool's (e.g. lowered for stuck episodes); None: the pool's.
    ceiling_gb: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise ValueError(f"worker_id={self.worker_id!r} is invalid: expected a non-empty worker id")
        context = f" for worker {self.worker_id!r}"
        if self.used_gb is not None:
            _check_nonneg("used_gb", self.used_gb, context)
        _check_nonneg("quota_gb", self.quota_gb, context)
        if self.ceiling_gb is not None:
            _check_nonneg("ceiling_gb", self.ceiling_gb, context)


@dataclass(frozen=True)
class QuotaConfig:
    """``step_gb``: grant increment. ``grow_when_used_fraction``: usage/quota at which a worker grows.
    ``slack_fraction``: margin above usage left to a worker when its grant is reclaimed (so a reclaim
    does not immediately trigger growth or an OOM). ``reserve_gb``: pool memory never granted (for the
    runtime, fragmentation, a worker about to join)."""

    step_gb: float = 1.0
    grow_when_used_fraction: float = 0.85
    slack_fraction: float = 0.10
    reserve_gb: float = 0.0

    def __post_init__(self) -> None:
        if not (_is_number(self.step_gb) and self.step_gb > 0):
            raise ValueError(f"step_gb={self.step_gb!r} is invalid: expected a finite number > 0")
        f = self.grow_when_used_fraction
        if not (_is_number(f) and 0 < f <= 1):
            raise ValueError(f"grow_when_used_fraction={f!r} is invalid: expected a number in (0, 1]")
        _check_nonneg("slack_fraction", self.slack_fraction)
        _check_nonneg("reserve_gb", self.reserve_gb)


@dataclass(frozen=True)
class PoolMemory:
    """The pool's memory after the plan. ``granted_gb``: sum of quotas. ``used_gb``: sum of reported
    usage. ``headroom_gb``: ``capacity - reserve - granted`` (negative: over-committed); None, like
    ``capacity_gb``, when the devices' memory is unknown. ``workers``: how many workers were planned."""

    capacity_gb: float | None
    granted_gb: float
    used_gb: float
    headroom_gb: float | None
    base_gb: float
    ceiling_gb: float
    workers: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "capacity_gb": self.capacity_gb,
            "granted_gb": self.granted_gb,
            "used_gb": self.used_gb,
            "headroom_gb": self.headroom_gb,
            "base_gb": self.base_gb,
            "ceiling_gb": self.ceiling_gb,
            "workers": self.workers,
        }


@dataclass(frozen=True)
class QuotaPlan:
    """``changes``: worker -> new quota, only for quotas that change. ``over_ceiling``: workers using more
    than the ceiling (sorted). ``reasons``: worker -> why it changed or is reported, for the event log."""

    changes: dict[str, float]
    over_ceiling: tuple[str, ...]
    accounting: PoolMemory
    reasons: dict[str, str] = field(default_factory=dict)

    def apply(self, workers: Sequence[WorkerMemory]) -> tuple[WorkerMemory, ...]:
        """``workers`` with the new quotas (what the next plan will see once the directives are applied)."""
        return tuple(WorkerMemory(w.worker_id, w.used_gb, self.changes.get(w.worker_id, w.quota_gb)) for w in workers)

    def to_dict(self) -> dict[str, Any]:
        return {
            "changes": dict(self.changes),
            "over_ceiling": list(self.over_ceiling),
            "accounting": self.accounting.to_dict(),
            "reasons": dict(self.reasons),
        }


def _grid_ceil(x: float, base: float, ceiling: float, step: float) -> float:
    """The smallest ``base + k * step`` >= x (k >= 0), capped at ``ceiling``."""
    if x <= base:
        return base
    k = math.ceil((x - base) / step - _EPS)
    return min(ceiling, base + k * step)


def plan(
    capacity_gb: float | None,
    base_gb: float,
    ceiling_gb: float,
    workers: Sequence[WorkerMemory],
    config: QuotaConfig | None = None,
) -> QuotaPlan:
    """Plan the quotas of one pool's workers. See the module docstring for the rules."""
    config = config if config is not None else QuotaConfig()
    if capacity_gb is not None:
        _check_nonneg("capacity_gb", capacity_gb)
    _check_nonneg("base_gb", base_gb)
    _check_nonneg("ceiling_gb", ceiling_gb)
    if ceiling_gb < base_gb:
        raise ValueError(f"ceiling_gb={ceiling_gb!r} is invalid: expected >= base_gb ({base_gb:g})")
    workers = tuple(workers)
    ids = [w.worker_id for w in workers]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise ValueError(f"worker_id={duplicates!r} appear more than once: expected one entry per worker")

    quota = {w.worker_id: float(w.quota_gb) for w in workers}
    notes: dict[str, list[str]] = {w.worker_id: [] for w in workers}

    # (1) The guarantee and the cap hold whatever else happens.
    for w in workers:
        if w.quota_gb < base_gb:
            quota[w.worker_id] = base_gb
            notes[w.worker_id].append(f"raised {w.quota_gb:g} -> {base_gb:g} GB: below the pool's base")
        elif w.quota_gb > ceiling_gb:
            quota[w.worker_id] = ceiling_gb
            notes[w.worker_id].append(f"lowered {w.quota_gb:g} -> {ceiling_gb:g} GB: above the pool's ceiling")

    # Capacity 0 is how devices of unknown memory add up: no device information, like None.
    usable: float | None = None
    if capacity_gb is not None and capacity_gb > 0:
        usable = max(0.0, capacity_gb - config.reserve_gb)
    if usable is not None:
        tol = _EPS * max(1.0, usable)
        granted = math.fsum(quota.values())
        if granted > usable + tol:
            _reclaim(workers, quota, notes, usable, tol, base_gb, ceiling_gb, config)
        else:
            _grow(workers, quota, notes, usable, tol, ceiling_gb, config)

    over_ceiling = tuple(sorted(w.worker_id for w in workers if w.used_gb is not None and w.used_gb > ceiling_gb))
    for w in workers:
        if w.worker_id in over_ceiling:
            notes[w.worker_id].append(
                f"over ceiling: uses {w.used_gb:g} GB > ceiling {ceiling_gb:g} GB (memory pressure, alert)"
            )

    changes = {w.worker_id: quota[w.worker_id] for w in workers if quota[w.worker_id] != w.quota_gb}
    granted_after = math.fsum(quota.values())
    accounting = PoolMemory(
        capacity_gb=float(capacity_gb) if capacity_gb is not None else None,
        granted_gb=granted_after,
        used_gb=math.fsum(w.used_gb for w in workers if w.used_gb is not None),
        headroom_gb=usable - granted_after if usable is not None else None,
        base_gb=float(base_gb),
        ceiling_gb=float(ceiling_gb),
        workers=len(workers),
    )
    reasons = {wid: "; ".join(lines) for wid, lines in notes.items() if lines}
    return QuotaPlan(changes=changes, over_ceiling=over_ceiling, accounting=accounting, reasons=reasons)


def _grow(
    workers: tuple[WorkerMemory, ...],
    quota: dict[str, float],
    notes: dict[str, list[str]],
    usable: float,
    tol: float,
    ceiling: float,
    config: QuotaConfig,
) -> None:
    """One step more for each worker near its quota, closest first, while the pool has room."""
    candidates: list[tuple[float, str, float, float]] = []
    for w in workers:
        q = quota[w.worker_id]
        own = ceiling if w.ceiling_gb is None else min(ceiling, w.ceiling_gb)
        # used > 0: a worker that uses nothing does not need more, even with a zero quota.
        if w.used_gb is None or w.used_gb <= 0 or q >= own:
            continue
        if w.used_gb >= config.grow_when_used_fraction * q:
            ratio = w.used_gb / q if q > 0 else math.inf
            candidates.append((-ratio, w.worker_id, w.used_gb, own))
    granted = math.fsum(quota.values())
    for _, wid, used, own in sorted(candidates):
        old = quota[wid]
        new = min(own, old + config.step_gb)
        # A worker whose step does not fit is skipped; a smaller step (capped at the ceiling) may still.
        if granted + (new - old) <= usable + tol:
            quota[wid] = new
            granted += new - old
            notes[wid].append(
                f"grown {old:g} -> {new:g} GB: uses {used:g} GB >= "
                f"{config.grow_when_used_fraction:.0%} of its quota, pool has headroom"
            )


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
