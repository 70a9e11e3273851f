"""The dual-threshold circuit breaker of one worker: a pure state machine over (telemetry samples, now).

Two caps — gradient-upload bandwidth (MB/s) and gradient-sync latency (ms) — plus the worker's memory
ceiling. When any of them is exceeded *sustainedly* the worker degrades one level of the ladder (see
``ladder.py``); it never gets killed. Rules, and why:

* **Evidence, not a sample.** OVERLOAD needs ``min_samples`` samples inside the last ``window_s`` of
  which at least ``overload_fraction`` exceed a cap, the newest one included. One slow sync is noise
  (the probe reports sharp spikes separately as anomalies).
* **Fresh evidence per level.** Each escalation issues a directive and waits for its ack; samples up to
  and including the beat that carried the ack are discarded, so the next level is justified only by
  what the worker did *with* the previous level in force. Hence at most one level per acked directive.
* **Hysteresis.** A sample is *calm* when every signal sits below ``cap * (1 - margin)``. Between
  that line and the cap a sample is neither calm nor overload: the breaker holds. A constant signal at
  the threshold therefore never makes it oscillate.
* **Half-open recovery.** After ``wait_s`` of uninterrupted calm the worker steps down one level and is
  probed for another ``wait_s``; a relapse while probing doubles ``wait_s`` (bounded by
  ``max_recovery_s``); reaching level 0 calmly closes the breaker and resets the wait.

States and transitions are the enum ``Phase`` and the table ``TRANSITIONS``; ``decide`` only looks
rows up. Every transition carries the evidence that caused it, so the control plane can record it.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from typing import Any

from dsec.breaker.ladder import MAX_LEVEL


class Phase(str, enum.Enum):
    CLOSED = "closed"  # level 0, healthy
    ESCALATING = "escalating"  # a higher level was issued; waiting for its ack
    OPEN = "open"  # degraded (level >= 1) and in force; watching for more overload or for calm
    RECOVERING = "recovering"  # a lower level was issued; waiting for its ack
    HALF_OPEN = "half_open"  # stepped down and in force; probing for relapse


class Trigger(str, enum.Enum):
    OVERLOAD = "overload"
    CALM = "calm"
    ACKED = "acked"


class Action(str, enum.Enum):
    NONE = "none"
    ESCALATE = "escalate"
    STEP_DOWN = "step_down"


# (phase, trigger, at_bound) -> (next phase, action). ``at_bound``: for OVERLOAD, the level is already
# the top of the ladder; for CALM, the level is already 0. Missing rows mean "ignore the trigger" —
# e.g. any OVERLOAD or CALM while a directive awaits its ack.
TRANSITIONS: dict[tuple[Phase, Trigger, bool], tuple[Phase, Action]] = {
    (Phase.CLOSED, Trigger.OVERLOAD, False): (Phase.ESCALATING, Action.ESCALATE),
    (Phase.ESCALATING, Trigger.ACKED, False): (Phase.OPEN, Action.NONE),
    (Phase.ESCALATING, Trigger.ACKED, True): (Phase.OPEN, Action.NONE),
    (Phase.OPEN, Trigger.OVERLOAD, False): (Phase.ESCALATING, Action.ESCALATE),
    (Phase.OPEN, Trigger.OVERLOAD, True): (Phase.OPEN, Action.NONE),  # top of the ladder: hold
    (Phase.OPEN, Trigger.CALM, False): (Phase.RECOVERING, Action.STEP_DOWN),
    (Phase.RECOVERING, Trigger.ACKED, False): (Phase.HALF_OPEN, Action.NONE),
    (Phase.RECOVERING, Trigger.ACKED, True): (Phase.HALF_OPEN, Action.NONE),
    (Phase.HALF_OPEN, Trigger.OVERLOAD, False): (Phase.ESCALATING, Action.ESCALATE),  # relapse
    (Phase.HALF_OPEN, Trigger.CALM, False): (Phase.RECOVERING, Action.STEP_DOWN),
    (Phase.HALF_OPEN, Trigger.CALM, True): (Phase.CLOSED, Action.NONE),
}


@dataclass(frozen=True)
class Caps:
    """The thresholds one worker runs under (pool defaults, per-worker overrides, policy changes)."""

    bandwidth_mbps: float = 128.0
    latency_ms: float = 85.0
    memory_gb: float | None = None  # the worker's memory ceiling; None: not judged

    def limits(self) -> dict[str, float]:
        out = {"bandwidth_mbps": self.bandwidth_mbps, "latency_ms": self.latency_ms}
        if self.memory_gb is not None:
            out["memory_gb"] = self.memory_gb
        return out


@dataclass(frozen=True)
class Sample:
    """One beat's worth of the breaker's signals; None: not measured in that interval (no sync)."""

    ts: float
    bandwidth_mbps: float | None = None
    latency_ms: float | None = None
    memory_gb: float | None = None

    def values(self) -> dict[str, float]:
        out = {}
        for name in ("bandwidth_mbps", "latency_ms", "memory_gb"):
            v = getattr(self, name)
            if v is not None and math.isfinite(v):
                out[name] = float(v)
        return out


@dataclass(frozen=True)
class BreakerConfig:
    window_s: float = 3.0
    min_samples: int = 3
    overload_fraction: float = 0.75
    margin: float = 0.2
    recovery_s: float = 30.0
    max_recovery_s: float = 600.0

    def __post_init__(self) -> None:
        checks = (
            ("window_s", self.window_s > 0, "> 0"),
            ("min_samples", self.min_samples >= 1, ">= 1"),
            ("overload_fraction", 0 < self.overload_fraction <= 1, "in (0, 1]"),
            ("margin", 0 <= self.margin < 1, "in [0, 1)"),
            ("recovery_s", self.recovery_s > 0, "> 0"),
            ("max_recovery_s", self.max_recovery_s >= self.recovery_s, ">= recovery_s"),
        )
        for name, ok, expected in checks:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: expected {expected}")


@dataclass(frozen=True)
class Transition:
    before: Phase
    after: Phase
    trigger: Trigger
    action: Action
    level_before: int
    level_after: int
    evidence: dict[str, Any]
    meltdown: bool = False  # an entry into degradation (level 0 -> 1)
    relapse: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "from": self.before.value,
            "to": self.after.value,
            "trigger": self.trigger.value,
            "action": self.action.value,
            "level_from": self.level_before,
            "level_to": self.level_after,
            "meltdown": self.meltdown,
            "relapse": self.relapse,
            "evidence": self.evidence,
        }


@dataclass
class Breaker:
    config: BreakerConfig = field(default_factory=BreakerConfig)
    phase: Phase = Phase.CLOSED
    level: int = 0
    wait_s: float = 0.0
    awaiting_version: int | None = None
    evidence_since: float = -math.inf
    calm_since: float | None = None
    calm_count: int = 0
    meltdowns: int = 0
    relapses: int = 0
    causes: tuple[str, ...] = ()
    # Each sample's finite signal values (extracted once, not per decision) and, at the same position, its time.
    # Two lists, not one of (ts, values) pairs: a pair holding a dict stays tracked by the garbage collector, and one
    # made per beat of every worker lived long enough to reach the oldest generation, whose full collections (each
    # over all workers' records) it brought forward; floats and dicts of floats are not tracked.
    # Lists, not deques: the window holds a few samples, and a deque's storage is 64-slot blocks (~0.5 KB each) that
    # it allocates anew each time its samples cross into the next block: two of them per worker (~1 KB) where a list
    # of three samples takes ~0.1 KB, and at 10,000 workers started together every breaker crossed its first block
    # on the same beat (the 33rd): a one-time ~10 MB step of the control plane's RSS (docs/benchmarks.md, the soak).
    _samples: list[dict[str, float]] = field(default_factory=list, repr=False)
    _sample_ts: list[float] = field(default_factory=list, repr=False)
    _undo: Breaker | None = field(default=None, repr=False, compare=False)
    # Whether the newest sample exceeds a cap: overload also requires "still over now", which keeps
    # the healthy heartbeat path O(1) (the window is only scanned when it can matter).
    _latest_over: bool = field(default=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.wait_s:
            self.wait_s = self.config.recovery_s

    @classmethod
    def resumed(cls, config: BreakerConfig, level: int, now: float) -> Breaker:
        """A breaker for a worker whose directive already has ``level`` in force (after a restart of the
        control plane): degraded workers resume OPEN and must show calm again before stepping down."""
        b = cls(config=config, level=level, phase=Phase.OPEN if level else Phase.CLOSED)
        b.evidence_since = now
        return b

    # -- inputs -----------------------------------------------------------------------------------
    def observe(self, sample: Sample, caps: Caps) -> None:
        self.observe_values(sample.ts, sample.values(), caps)

    def observe_values(self, ts: float, values: dict[str, float], caps: Caps) -> None:
        """``observe`` of a sample at ``ts`` whose ``values()`` are ``values`` (kept: not to be changed after)."""
        if ts <= self.evidence_since:
            return
        limits = caps.limits()
        # One pass for both questions (every beat of every worker asks them): is any signal over its cap, and is
        # every signal under its cap by the hysteresis margin.
        over, calm, keep = False, True, 1 - self.config.margin
        for k, v in values.items():
            cap = limits.get(k)
            if cap is not None:
                over = over or v > cap
                calm = calm and v < cap * keep
        self._latest_over = over
        times = self._sample_ts
        times.append(ts)
        self._samples.append(values)
        horizon = ts - self.config.window_s  # calm is tracked by calm_since, not by samples
        if times[0] < horizon:  # drop the leading samples older than the window (times[-1] is ts: one stays)
            old = 1
            while times[old] < horizon:
                old += 1
            del times[:old], self._samples[:old]
        if calm:
            if self.calm_since is None:
                self.calm_since = ts
                self.calm_count = 0
            self.calm_count += 1
        else:
            self.calm_since = None
            self.calm_count = 0

    def window_median(self, name: str) -> float | None:
        """The median of signal ``name`` over the samples in the evidence window (None: none carries it)."""
        vals = sorted(v[name] for v in self._samples if name in v)
        if not vals:
            return None
        mid = len(vals) // 2
        return vals[mid] if len(vals) % 2 else 0.5 * (vals[mid - 1] + vals[mid])

    def issued(self, version: int, now: float) -> None:
        """The caller published the directive carrying the last ESCALATE / STEP_DOWN as ``version``."""
        self.awaiting_version = version
        self._fresh(now)

    def _fresh(self, now: float) -> None:
        self.evidence_since = now
        self._latest_over = False
        self._samples.clear()
        self._sample_ts.clear()
        self.calm_since = None
        self.calm_count = 0

    # -- decision ---------------------------------------------------------------------------------
    def decide(self, now: float, caps: Caps, acked_version: int, top_level: int = MAX_LEVEL) -> Transition | None:
        """``top_level``: the highest level this worker may reach now (below ``MAX_LEVEL`` where the top rung would
        not pay, ``dsec.decide.pause``); a worker already above it is not stepped down for it, only held."""
        trigger, evidence = self._trigger(now, caps, acked_version)
        if trigger is None:
            return None
        at_bound = self.level >= top_level if trigger is Trigger.OVERLOAD else self.level == 0
        row = TRANSITIONS.get((self.phase, trigger, at_bound))
        if row is None:
            return None
        # What the caller restores if it cannot publish this decision (e.g. the store is down).
        self._undo = replace(self, _samples=self._samples.copy(), _sample_ts=self._sample_ts.copy(), _undo=None)
        after, action = row
        before, level_before = self.phase, self.level
        meltdown = relapse = False
        if trigger is Trigger.ACKED:
            self.awaiting_version = None
            self._fresh(now)  # the ack beat itself still describes the old level
        if action is Action.ESCALATE:
            self.level += 1
            meltdown = level_before == 0
            relapse = before is Phase.HALF_OPEN
            if relapse:
                self.relapses += 1
                self.wait_s = min(self.wait_s * 2, self.config.max_recovery_s)
            if meltdown:
                self.meltdowns += 1
                self.causes = tuple(evidence.get("over", {}))
        elif action is Action.STEP_DOWN:
            self.level -= 1
        if after is Phase.CLOSED:
            self.wait_s = self.config.recovery_s
            self.causes = ()
        if (after, action) == (before, Action.NONE):
            return None  # holding at the top of the ladder is not a transition
        self.phase = after
        return Transition(before, after, trigger, action, level_before, self.level, evidence, meltdown, relapse)

    def _trigger(self, now: float, caps: Caps, acked_version: int) -> tuple[Trigger | None, dict[str, Any]]:
        if self.awaiting_version is not None:
            if acked_version >= self.awaiting_version:
                return Trigger.ACKED, {"acked_version": acked_version}
            return None, {}
        if self._latest_over and len(self._samples) >= self.config.min_samples:
            start = now - self.config.window_s
            window = [v for ts, v in zip(self._sample_ts, self._samples, strict=True) if ts > start]
            over = self._overload(window, caps)
            if over is not None:
                return Trigger.OVERLOAD, over
        if self.calm_since is not None and self.calm_count >= self.config.min_samples:
            calm_for = now - self.calm_since
            if calm_for >= self.wait_s:
                return Trigger.CALM, {
                    "calm_for_s": round(calm_for, 3),
                    "wait_s": self.wait_s,
                    "samples": self.calm_count,
                    "margin": self.config.margin,
                    "caps": caps.limits(),
                }
        return None, {}

    def _overload(self, window: list[dict[str, float]], caps: Caps) -> dict[str, Any] | None:
        if len(window) < self.config.min_samples:
            return None
        limits = caps.limits()
        over: dict[str, dict[str, float]] = {}
        for name, cap in limits.items():
            values = [v[name] for v in window if name in v]
            if len(values) < self.config.min_samples:
                continue
            exceeding = [x for x in values if x > cap]
            if len(exceeding) >= self.config.overload_fraction * len(values):
                over[name] = {
                    "cap": cap,
                    "median": sorted(values)[len(values) // 2],
                    "max": max(values),
                    "exceeding": len(exceeding),
                    "samples": len(values),
                }
        if not over:
            return None
        since = self.evidence_since if math.isfinite(self.evidence_since) else None
        return {"over": over, "window_s": self.config.window_s, "evidence_since": since}

    def undo(self) -> Breaker | None:
        """The state before the last transition (None when there was none)."""
        return self._undo

    def to_dict(self) -> dict[str, Any]:
        return {
            "phase": self.phase.value,
            "level": self.level,
            "wait_s": self.wait_s,
            "awaiting_version": self.awaiting_version,
            "meltdowns": self.meltdowns,
            "relapses": self.relapses,
            "causes": list(self.causes),
        }
