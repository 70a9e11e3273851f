"""Two small judgments besides the breaker, pure functions of (state, input, now):

* **Stuck episodes** — an agent whose last N episodes all ended interrupted (a collision loop, a crashing
  simulator) is burning its peers' sync time for nothing: lower its memory ceiling one step and its sync
  priority one level, and raise ``<agent>_episode_stuck_<reason>_<N>x``. It keeps running.
* **Precision fallback** — non-finite gradients, or a gradient norm beyond ``spike_factor`` times the
  worker's recent median, move the worker one step along a configurable precision mapping (default
  bf16 -> fp16, fp16 -> fp32) with an alert; after ``stable_s`` without a new instability it returns to
  the precision it had before.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEFAULT_PRECISION_FALLBACK: Mapping[str, str] = {"bf16": "fp16", "fp16": "fp32"}
NORMS_KEPT = 32  # gradient norms a precision guard keeps for its spike median


def agent_name(role: str, group: str, rank: int) -> str:
    """A stable, metric-safe agent label: ``actor3`` or ``grp-b.actor3``."""
    base = f"{role}{rank}"
    name = base if group in ("", "default") else f"{group}.{base}"
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", name)


@dataclass(frozen=True)
class StuckDecision:
    patch: dict[str, Any]
    alert: str
    data: dict[str, Any]


def stuck_episode(
    fields: Mapping[str, Any],
    pool_base_gb: float,
    pool_ceiling_gb: float,
    agent: str,
    reason: str,
    count: int,
    step_gb: float = 1.0,
) -> StuckDecision:
    """Lower the memory ceiling one step (never below the worker's quota or the pool's base) and the
    sync priority one level (floor -10)."""
    ceiling = fields.get("memory_ceiling_gb") or pool_ceiling_gb
    quota = fields.get("memory_quota_gb") or pool_base_gb
    # min(): a ceiling already below the floor (an operator's choice) is kept, never raised.
    new_ceiling = min(float(ceiling), max(float(quota), float(pool_base_gb), float(ceiling) - step_gb))
    priority = max(-10, int(fields.get("sync_priority") or 0) - 1)
    patch: dict[str, Any] = {"sync_priority": priority}
    if new_ceiling != ceiling:
        patch["memory_ceiling_gb"] = new_ceiling
    safe_reason = re.sub(r"[^A-Za-z0-9_]", "_", reason) or "unknown"
    return StuckDecision(
        patch=patch,
        alert=f"{agent}_episode_stuck_{safe_reason}_{count}x",
        data={
            "reason": reason,
            "count": count,
            "memory_ceiling_gb": [ceiling, new_ceiling],
            "sync_priority": [fields.get("sync_priority") or 0, priority],
        },
    )


@dataclass
class PrecisionGuard:
    """Per-worker precision fallback state. ``observe`` feeds gradient norms; ``instability`` reports a
    non-finite gradient. Both return a patch (and why) when the precision must change."""

    mapping: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_PRECISION_FALLBACK))
    spike_factor: float = 10.0
    min_history: int = 5
    stable_s: float = 300.0
    original: str | None = None
    last_instability: float | None = None
    # The last NORMS_KEPT norms, oldest first. A list, not a deque(maxlen=...): a deque's storage is 64-slot blocks
    # (~0.5 KB) and it takes a second one when its norms cross into the next block, which every worker of a job
    # started together does on the same beat (the breaker's window had the same step: docs/benchmarks.md, the soak).
    _norms: list[float] = field(default_factory=list)

    def observe(self, grad_norm: float, current: str, now: float) -> tuple[dict[str, Any], dict[str, Any]] | None:
        if not math.isfinite(grad_norm):
            return self.instability("non_finite_gradient", current, now, {"grad_norm": str(grad_norm)})
        history = sorted(self._norms)
        self._norms.append(grad_norm)
        if len(self._norms) > NORMS_KEPT:
            del self._norms[0]
        if len(history) >= self.min_history:
            median = history[len(history) // 2]
            if median > 0 and grad_norm > self.spike_factor * median:
                return self.instability("grad_norm_spike", current, now, {"grad_norm": grad_norm, "median": median})
        return None

    def instability(
        self, kind: str, current: str, now: float, data: Mapping[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]] | None:
        self.last_instability = now
        target = self.mapping.get(current)
        if target is None or target == current:
            return None  # nothing safer to fall back to; the alert still goes out via the caller
        if self.original is None:
            self.original = current
        return {"precision": target}, {"kind": kind, "from": current, "to": target, **data}

    def revert(self, current: str, now: float) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """After ``stable_s`` without instability, go back to the precision before the fallback."""
        if self.original is None or self.last_instability is None:
            return None
        if now - self.last_instability < self.stable_s:
            return None
        original, self.original = self.original, None
        if original == current:
            return None
        return {"precision": original}, {
            "kind": "precision_restored",
            "from": current,
            "to": original,
            "stable_s": round(now - self.last_instability, 3),
        }
