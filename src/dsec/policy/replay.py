"""What-if replay: run a policy file over recorded or synthetic metric series in virtual time.

Knobs start at a pool's defaults (or the values given) and follow the rules' applied actions, so a rule that
tightens a cap sees its own earlier changes. Nothing sleeps: a day of series replays in milliseconds.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

from dsec.model import Pool
from dsec.policy.engine import Decision, Engine, Scope, Transition
from dsec.policy.rules import Knob, PolicySet
from dsec.policy.series import SeriesStore


@dataclass
class ReplayResult:
    start: float
    end: float
    decisions: list[Decision] = field(default_factory=list)
    transitions: list[Transition] = field(default_factory=list)
    knobs: dict[tuple[str, str, str], float] = field(default_factory=dict)  # (level, scope, knob) -> final


def _default(scope: Scope, knob: Knob) -> float | None:
    pool = Pool(scope.pool)
    if knob.name in ("latency_cap_ms", "bandwidth_cap_mbps"):
        return float(getattr(pool.thresholds, knob.name))
    if knob.level == "worker":
        # compression_bits is absent: its default is None (the probe's level), as in the live control plane.
        return {"grad_accum_steps": 1.0, "sync_priority": 0.0,
                "snapshot_compression_level": float(pool.snapshot_compression_level),
                "snapshot_interval_s": pool.snapshot_interval_s,
                "memory_ceiling_gb": pool.memory_ceiling_gb}.get(knob.name)  # fmt: skip
    value = getattr(pool, knob.name, None)
    return None if value is None else float(value)


def replay(
    policies: PolicySet,
    series: SeriesStore,
    *,
    step_s: float = 15.0,
    start: float | None = None,
    end: float | None = None,
    initial: dict[tuple[str, str], float] | None = None,
    suppressed: dict[str, tuple[float, float]] | None = None,
) -> ReplayResult:
    """Evaluate every ``step_s`` from ``start`` to ``end`` (default: the series' span). ``initial`` maps
    (scope key, knob) to a starting value; ``suppressed`` maps a pool to a (from, until) recovery window."""
    span = series.span()
    if span is None:
        raise ValueError("the series file holds no samples")
    if step_s <= 0:
        raise ValueError(f"step {step_s} is invalid: expected > 0 seconds")
    t0 = span[0] if start is None else start
    t1 = span[1] if end is None else end
    engine = Engine(policies)
    knobs: dict[tuple[str, str, str], float] = {}
    for (scope_key, name), value in (initial or {}).items():
        for level in ("pool", "worker"):
            knobs[(level, scope_key, name)] = float(value)
    pools = sorted({k[1] for k in series.series_keys()})
    workers = sorted({(k[1], k[2]) for k in series.series_keys() if k[2] is not None})
    scopes = [Scope(p) for p in pools] + [Scope(p, w) for p, w in workers]

    def read(scope: Scope, knob: Knob) -> float | None:
        key = (knob.level, scope.key, knob.name)
        if key in knobs:
            return knobs[key]
        if knob.level == "worker" and knob.name in ("latency_cap_ms", "bandwidth_cap_mbps"):
            pool_key = ("pool", scope.pool, knob.name)
            if pool_key in knobs:
                return knobs[pool_key]
        return _default(scope, knob)

    def is_suppressed(pool: str, now: float) -> bool:
        window = (suppressed or {}).get(pool)
        return window is not None and window[0] <= now < window[1]

    out = ReplayResult(t0, t1)
    steps = math.floor((t1 - t0) / step_s + 1e-9) + 1
    for i in range(steps):
        now = t0 + i * step_s
        decisions, transitions = engine.evaluate(now, scopes, series, read, functools.partial(is_suppressed, now=now))
        for d in decisions:
            if d.changes and d.new is not None:
                knobs[(d.level, d.scope.key, d.knob)] = d.new
        out.decisions += decisions
        out.transitions += transitions
    out.knobs = knobs
    return out
