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
- Over ceiling: a worker whose usage exceeds ``ceiling_gb`` is reported in ``over_ceiling`` (and its
  note says so). The planner never kills anything. Where the breaker's memory path is on
  (``DSEC_MEMORY_PRESSURE``; off as shipped), the breaker degrades such a worker and alerts.
- No device information: ``capacity_gb`` None, or 0 (what ``Device.memory_gb`` reports when the memory
  is unknown), means the pool's capacity is unknown. Then quotas are only clamped to [base, ceiling]:
  no growth beyond what was granted (it could over-commit real devices) and no reclaim (there is
  nothing to fit into).
- No usage report (``used_gb`` None): the worker is not grown (no evidence it needs more) and keeps
  its quota, except when the pool is over-committed and the workers that do report cannot give back
  enough; then it gives back just what is needed to fit, largest grant first, never below base.

- Growth by deficit and ramp: a growing worker is granted at least one step, and at least what it will use
  ``ramp_horizon_s`` from now at its observed ramp (``ramp_gb_per_s``), plus slack — a burst ramping at
  0.3 GB/s outruns 1 GB per plan; the grant has to lead it, not trail it.
- Idle grants: a worker whose recent peak (``recent_peak_gb``, kept by the caller over a window) leaves a grant
  at least one step above what that peak needs gives the surplus back, to ``peak * (1 + slack) /
  grow_when_used_fraction`` on the grid — a level at which the same usage does not grow again (no oscillation).
  A grant that outlives its burst strands memory the card's other workers could burst into.

Grant and limit (requests and limits)
-------------------------------------
A quota is a *grant*: memory reserved for the worker, never promised to anyone else. What the worker's
allocator may actually take is its *limit*: its grant, or all the memory its neighbours do not hold now when that
is more, capped at the device, and at the ceiling unless the worker is in a burst (a steep ramp: a slow leak is
stopped at the ceiling, fails early and alone, and placement learns its card). A burst therefore runs into free memory
instead of failing at the grant (which turns a card with free memory into an OOM no deployment without quotas
would have: the first design's hard cap at the grant did exactly that). Concurrent bursts can still fill a card, as
without quotas. The pool's ceiling bounds the *grant*; above it only a burst runs, up to the limit.
Limits are re-issued when they move by a full step either way or fall below the grant (hysteresis), and only for
workers that report usage. Unknown capacity: no limit.

Quotas move on a grid ``base + k * step`` (capped at the ceiling), so growth and reclaim land on the
same values. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dsec.quota.grants import _EPS, _grow, _reclaim, _reclaim_idle
from dsec.quota.grants import _grid_ceil as _grid_ceil  # re-exported: the grid's tests import it from here


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check_nonneg(name: str, value: object, context: str = "") -> None:
    if type(value) is float and 0.0 <= value < math.inf:  # the common case, decided by the full test below too
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{name}={value!r}{context} is invalid: expected a finite number >= 0")


_INF = math.inf


def _plain(w: WorkerMemory) -> bool:
    """The common valid case of a WorkerMemory in one expression: a non-empty string id and every number a finite
    float >= 0 (or None where None is allowed). Anything else goes through the field-by-field checks, which accept
    the same values and name the field that fails. Every plan builds one per worker (the simulator: ~1.4 M an
    hour at 10,000 workers), where the checks' loop and calls were a third of the planning time."""
    u, c, p, lim = w.used_gb, w.ceiling_gb, w.recent_peak_gb, w.limit_gb
    q, r = w.quota_gb, w.ramp_gb_per_s
    return bool(
        type(w.worker_id) is str
        and w.worker_id
        and type(q) is float
        and 0.0 <= q < _INF
        and type(r) is float
        and 0.0 <= r < _INF
        and (u is None or (type(u) is float and 0.0 <= u < _INF))
        and (c is None or (type(c) is float and 0.0 <= c < _INF))
        and (p is None or (type(p) is float and 0.0 <= p < _INF))
        and (lim is None or (type(lim) is float and 0.0 <= lim < _INF))
    )


@dataclass(slots=True)
class WorkerMemory:
    """One worker's current quota and its last reported usage (None: no report yet). Not frozen (the plan never
    changes its inputs; ``QuotaPlan.apply`` returns new ones): a frozen dataclass sets each field through
    ``object.__setattr__``, 4x the cost of a slots class here (2.3 vs 0.55 µs), and every plan builds one per
    worker."""

    worker_id: str
    used_gb: float | None
    quota_gb: float
    # The worker's own ceiling when lower than the pool's (e.g. lowered for stuck episodes); None, or one at or above
    # the pool's (what every worker registers with): the pool's.
    ceiling_gb: float | None = None
    # Observed growth of ``used_gb`` (GB/s, >= 0) and the highest usage over the caller's recent window (None: not
    # tracked: no idle reclaim). See MemoryTrend.
    ramp_gb_per_s: float = 0.0
    recent_peak_gb: float | None = None
    # The allocator limit in force (None: none issued yet).
    limit_gb: float | None = None
    # In a burst (MemoryTrend.bursting): only then may the limit run past the ceiling into free memory.
    bursting: bool = False

    def __post_init__(self) -> None:
        if _plain(self):
            return
        if not isinstance(self.worker_id, str) or not self.worker_id:
            raise ValueError(f"worker_id={self.worker_id!r} is invalid: expected a non-empty worker id")
        context = f" for worker {self.worker_id!r}"
        for name, value in (
            ("used_gb", self.used_gb),
            ("quota_gb", self.quota_gb),
            ("ceiling_gb", self.ceiling_gb),
            ("ramp_gb_per_s", self.ramp_gb_per_s),
            ("recent_peak_gb", self.recent_peak_gb),
            ("limit_gb", self.limit_gb),
        ):
            # None is "not reported / not set" for every field but quota_gb and ramp_gb_per_s, which it fails.
            if value is None and name not in ("quota_gb", "ramp_gb_per_s"):
                continue
            _check_nonneg(name, value, context)


@dataclass(frozen=True)
class QuotaConfig:
    """``step_gb``: grant increment. ``grow_when_used_fraction``: usage/quota at which a worker grows.
    ``slack_fraction``: margin above usage left to a worker when its grant is reclaimed (so a reclaim
    does not immediately trigger growth or an OOM). ``reserve_gb``: pool memory never granted (for the
    runtime, fragmentation, a worker about to join). ``ramp_horizon_s``: how far ahead growth covers a worker's
    observed ramp (two plan intervals: the grant must still lead when the next plan runs)."""

    step_gb: float = 1.0
    grow_when_used_fraction: float = 0.85
    slack_fraction: float = 0.10
    reserve_gb: float = 0.0
    ramp_horizon_s: float = 4.0

    def __post_init__(self) -> None:
        if not (_is_number(self.step_gb) and self.step_gb > 0):
            raise ValueError(f"step_gb={self.step_gb!r} is invalid: expected a finite number > 0")
        f = self.grow_when_used_fraction
        if not (_is_number(f) and 0 < f <= 1):
            raise ValueError(f"grow_when_used_fraction={f!r} is invalid: expected a number in (0, 1]")
        _check_nonneg("slack_fraction", self.slack_fraction)
        _check_nonneg("reserve_gb", self.reserve_gb)
        _check_nonneg("ramp_horizon_s", self.ramp_horizon_s)


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
    # worker -> the allocator limit to issue, only where it changes (see "Grant and limit"); None: no limit.
    limit_changes: dict[str, float | None] = field(default_factory=dict)

    def apply(self, workers: Sequence[WorkerMemory]) -> tuple[WorkerMemory, ...]:
        """``workers`` with the new quotas and limits (what the next plan sees once the directives are applied)."""
        return tuple(
            replace(
                w,
                quota_gb=self.changes.get(w.worker_id, w.quota_gb),
                limit_gb=self.limit_changes.get(w.worker_id, w.limit_gb),
            )
            for w in workers
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "changes": dict(self.changes),
            "limit_changes": dict(self.limit_changes),
            "over_ceiling": list(self.over_ceiling),
            "accounting": self.accounting.to_dict(),
            "reasons": dict(self.reasons),
        }


def plan(
    capacity_gb: float | None,
    base_gb: float,
    ceiling_gb: float,
    workers: Sequence[WorkerMemory],
    config: QuotaConfig | None = None,
    device_gb: float | None = None,
) -> QuotaPlan:
    """Plan the quotas of one pool's workers. See the module docstring for the rules. ``device_gb``: the memory
    of one device (a limit never exceeds it); None: ``capacity_gb``."""
    config = config if config is not None else QuotaConfig()
    workers = _checked(capacity_gb, base_gb, ceiling_gb, workers)

    quota = {w.worker_id: float(w.quota_gb) for w in workers}
    notes: dict[str, list[str]] = defaultdict(list)  # only workers with something to say get a list

    # (1) The guarantee and the cap hold whatever else happens.
    _clamp(workers, quota, notes, base_gb, ceiling_gb)

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
            idle = _reclaim_idle(workers, quota, notes, base_gb, ceiling_gb, config)
            _grow([w for w in workers if w.worker_id not in idle], quota, notes, usable, tol, ceiling_gb, config)

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
    limit_changes: dict[str, float | None] = {}
    if usable is not None:
        card = float(device_gb) if device_gb else float(capacity_gb or 0.0)
        limit_changes = _limits(workers, quota, usable, card, ceiling_gb, config)
    reasons = {w.worker_id: "; ".join(notes[w.worker_id]) for w in workers if notes.get(w.worker_id)}
    return QuotaPlan(
        changes=changes, over_ceiling=over_ceiling, accounting=accounting, reasons=reasons, limit_changes=limit_changes
    )


def _checked(
    capacity_gb: float | None, base_gb: float, ceiling_gb: float, workers: Sequence[WorkerMemory]
) -> tuple[WorkerMemory, ...]:
    """The plan's inputs checked (ValueError when invalid); the workers as a tuple."""
    if capacity_gb is not None:
        _check_nonneg("capacity_gb", capacity_gb)
    _check_nonneg("base_gb", base_gb)
    _check_nonneg("ceiling_gb", ceiling_gb)
    if ceiling_gb < base_gb:
        raise ValueError(f"ceiling_gb={ceiling_gb!r} is invalid: expected >= base_gb ({base_gb:g})")
    workers = tuple(workers)
    ids = [w.worker_id for w in workers]
    if len(set(ids)) == len(ids):
        return workers
    duplicates = sorted(i for i, n in Counter(ids).items() if n > 1)  # not ids.count: quadratic at 10k workers
    if duplicates:
        raise ValueError(f"worker_id={duplicates!r} appear more than once: expected one entry per worker")
    return workers


def _clamp(
    workers: tuple[WorkerMemory, ...], quota: dict[str, float], notes: dict[str, list[str]], base: float, ceiling: float
) -> None:
    """Every quota into [base, ceiling]."""
    for w in workers:
        if w.quota_gb < base:
            quota[w.worker_id] = base
            notes[w.worker_id].append(f"raised {w.quota_gb:g} -> {base:g} GB: below the pool's base")
        elif w.quota_gb > ceiling:
            quota[w.worker_id] = ceiling
            notes[w.worker_id].append(f"lowered {w.quota_gb:g} -> {ceiling:g} GB: above the pool's ceiling")


def _limits(
    workers: tuple[WorkerMemory, ...],
    quota: dict[str, float],
    usable: float,
    card: float,
    ceiling_gb: float,
    config: QuotaConfig,
) -> dict[str, float | None]:
    """The allocator limit of each reporting worker, where it changes (see "Grant and limit"). ``card``: the memory
    of one device."""
    limit_changes: dict[str, float | None] = {}
    # What each worker holds now: its usage (no report: its whole grant). A limit is the worker's grant, or
    # all the memory its neighbours do not hold now if that is more — so a burst may borrow memory a
    # neighbour was granted but does not use; giving it back when the neighbour needs it is the pressure
    # path's job (the breaker's memory cap sits below the limit), not a wall at the grant.
    held = {w.worker_id: w.used_gb if w.used_gb is not None else quota[w.worker_id] for w in workers}
    total_held = math.fsum(held.values())
    hysteresis = config.step_gb - _EPS
    for w in workers:
        used = w.used_gb  # what it holds (held[w.worker_id]) when it reports
        if used is None:  # no report: nothing to size a limit by; it keeps the one it has (registration issues
            # the pool's ceiling, DirectiveFields.for_pool; None in directives from before that: the grant caps it)
            continue
        q = quota[w.worker_id]
        limit = min(card, max(q, usable - (total_held - used)))
        # A ceiling of the worker's own binds only below the pool's: every worker registers with the pool's ceiling in
        # its directive fields, and counting that as its own stopped every burst there (the server passed it, the
        # simulator passes None; until 2026-12-06 no burst ran past the ceiling on the server).
        lowered = w.ceiling_gb is not None and w.ceiling_gb < ceiling_gb
        if not w.bursting or lowered:
            # Past the ceiling only for a burst: a slow leak stops there (fails early, alone, and placement
            # learns its card); a ceiling lowered for this worker (stuck episodes) is a hard bound.
            own = ceiling_gb if w.ceiling_gb is None else min(ceiling_gb, w.ceiling_gb)
            limit = min(limit, max(q, own))
        old = w.limit_gb
        # One step of hysteresis both ways: a limit follows every neighbour's usage, and a directive per
        # wobble would churn versions (and the acks the breaker's directives wait for). A limit may thus
        # run up to a step above what is free; a full card is then handled as without quotas.
        if old is None or abs(limit - old) >= hysteresis or old < q:
            limit_changes[w.worker_id] = limit
    return limit_changes
