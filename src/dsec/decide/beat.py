"""Per-beat decisions about one worker: its circuit breaker, the precision guard, and the anomalies its probe
reported (stuck episodes, replica drift, non-finite gradients).

A decision made here rides back in the same heartbeat answer, so detection -> directive costs no extra round
trip. The breaker and the guard are the worker's own decision state, handed in by their owner.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from dsec.alerts.model import Severity
from dsec.breaker import MAX_LEVEL, Action, Breaker, Caps, Transition, fields_for
from dsec.decide.caps import finite, sample_values
from dsec.decide.pause import pause_pays
from dsec.decide.verdicts import Verdict, alert_event
from dsec.decide.views import WorkerView
from dsec.health.interventions import PrecisionGuard, stuck_episode
from dsec.model import Event, EventType, Pool


@dataclass(frozen=True)
class BreakerMove:
    """A breaker transition and, when it acts, the directive patch of its new ladder level."""

    transition: Transition
    patch: dict[str, Any] | None


def breaker_step(
    breaker: Breaker,
    caps: Caps,
    acked_version: int,
    now: float,
    default_bits: int | None = None,
    top_level: int = MAX_LEVEL,
) -> BreakerMove | None:
    """Let ``breaker`` decide at ``now`` (after its samples were observed); None when it stays put.
    ``default_bits``: the compression a worker recovered to level 0 runs at (its pool's ``compression_bits``);
    ``top_level``: the highest level it may reach now (:func:`top_level`)."""
    t = breaker.decide(now, caps, acked_version, top_level)
    if t is None:
        return None
    patch = (
        fields_for(t.level_after, breaker.causes, caps.memory_gb, default_bits) if t.action is not Action.NONE else None
    )
    return BreakerMove(t, patch)


def breaker_events(w: WorkerView, move: BreakerMove, caps: Caps, now: float) -> list[Event]:
    """The breaker's transition as an event (``meltdown`` / ``recovered`` / ``breaker``), with a warning alert on
    a meltdown."""
    t = move.transition
    etype = EventType.MELTDOWN if t.meltdown else EventType.RECOVERED if t.after.value == "closed" else None
    data = {"kind": "breaker", **t.to_dict(), "caps": caps.limits()}
    out = [Event(ts=now, type=etype or EventType.BREAKER, worker_id=w.id, pool=w.pool, data=data)]
    if t.meltdown:
        causes = sorted(t.evidence.get("over", {}))
        out.append(
            alert_event(
                now,
                f"{w.agent}_meltdown_{'_'.join(causes) or 'overload'}",
                Severity.WARNING,
                f"breaker opened on {', '.join(causes)}: degraded to level 1",
                data,
                w.id,
                w.pool,
            )
        )
    return out


def top_level(role: str, cost_ms: float | None, accum: float, step_ms: float | None, actors: int | None) -> int:
    """The highest ladder level a worker may reach: the top rung (sampling paused) only for an actor whose lateness
    costs its group more than its samples are worth (``dsec.decide.pause.pause_pays``). A learner keeps the whole
    ladder (the probe never holds a learner's env.step, so its top rung changes nothing but the directive)."""
    if role != "actor" or pause_pays(cost_ms, accum, step_ms, actors or 0):
        return MAX_LEVEL
    return MAX_LEVEL - 1


class BeatInputs(NamedTuple):
    """One accepted heartbeat of ``worker``: its metrics, its events as recorded, the directive version it acked;
    ``actors``: its pool's active actors at the last periodic pass (None: not counted yet); ``step_ms``: its pool's
    learners' median step time then (:func:`dsec.decide.pause.learner_step_ms`; None: none reported). Immutable as a
    named tuple, made for every beat: ~0.26 µs to construct, where a frozen dataclass (an ``object.__setattr__`` per
    field) took ~1.0 (timeit, best of 5, 2026-12-07)."""

    worker: WorkerView
    pool: Pool | None
    caps: Caps
    metrics: Mapping[str, Any]
    events: Sequence[Event]
    acked_version: int
    now: float
    actors: int | None = None
    step_ms: float | None = None


def judge_beat(beat: BeatInputs, breaker: Breaker, guard: PrecisionGuard) -> Verdict:
    """Everything one beat decides: the breaker's move, anomaly responses, the precision guard's fallback."""
    verdict = Verdict()
    w, now = beat.worker, beat.now
    if beat.metrics:
        breaker.observe_values(now, sample_values(beat.metrics), beat.caps)  # observe(sample_from(...)), less a Sample
    top = MAX_LEVEL
    if w.role == "actor" and breaker.level >= MAX_LEVEL - 1:  # (only there can the rule decide anything)
        # Sustained lateness, as the breaker's own evidence is: its window's median sync cost, not one beat's.
        top = top_level(
            w.role,
            breaker.window_median("latency_ms"),
            float(w.fields.grad_accum_steps),
            # Its own step time, else its group's: an actor that steps no optimizer reports none.
            (finite(beat.metrics, "step_ms_mean") if beat.metrics else None) or beat.step_ms,
            beat.actors,
        )
    default_bits = beat.pool.compression_bits if beat.pool else None
    move = breaker_step(breaker, beat.caps, beat.acked_version, now, default_bits, top)
    if move is not None:
        verdict.breaker_moved = True
        if move.patch is not None:
            verdict.add("breaker", move.patch)
            verdict.breaker_issued = True
        verdict.events += breaker_events(w, move, beat.caps, now)
    for ev in beat.events:
        if ev.type is EventType.ANOMALY:
            _on_anomaly(beat, ev, guard, verdict)
    grad_norm = beat.metrics.get("grad_norm") if beat.metrics else None
    if isinstance(grad_norm, (int, float)) and not isinstance(grad_norm, bool):
        decision = guard.observe(float(grad_norm), w.fields.precision, now)
        if decision is not None:
            _precision(w, decision, now, verdict)
    return verdict


def _on_anomaly(beat: BeatInputs, ev: Event, guard: PrecisionGuard, verdict: Verdict) -> None:
    w, now, kind = beat.worker, beat.now, ev.data.get("kind")
    if kind == "episode_stuck":
        if beat.pool is None:
            return
        count = ev.data.get("count")
        d = stuck_episode(
            {**w.fields.to_dict(), **verdict.patch},
            beat.pool.memory_base_gb,
            beat.pool.memory_ceiling_gb,
            w.agent,
            str(ev.data.get("reason") or "unknown"),
            int(count) if isinstance(count, int) else 0,
        )
        verdict.add("stuck_episode", d.patch)
        verdict.events.append(
            alert_event(now, d.alert, Severity.WARNING, "consecutive interrupted episodes", d.data, w.id, w.pool)
        )
    elif kind == "replica_drift":
        # DDP replicas that no longer hold the same weights train different models and average their
        # gradients: nothing downstream of this is trustworthy until they are made identical again.
        summary = str(ev.data.get("message") or "replica parameters differ from the group's")
        verdict.events.append(
            alert_event(now, f"{w.agent}_replica_drift", Severity.CRITICAL, summary, dict(ev.data), w.id, w.pool)
        )
    elif kind == "non_finite_gradient":
        decision = guard.instability(
            "non_finite_gradient", w.fields.precision, now, {"grad_norm": ev.data.get("grad_norm")}
        )
        if decision is not None:
            _precision(w, decision, now, verdict)
        else:
            summary = f"non-finite gradient at precision {w.fields.precision}; no fallback configured"
            verdict.events.append(
                alert_event(
                    now, f"{w.agent}_non_finite_gradient", Severity.CRITICAL, summary, dict(ev.data), w.id, w.pool
                )
            )


def _precision(w: WorkerView, decision: tuple[dict[str, Any], dict[str, Any]], now: float, verdict: Verdict) -> None:
    patch, data = decision
    verdict.add("precision_fallback", patch)
    name = f"{w.agent}_precision_fallback_{data['from']}_to_{data['to']}"
    summary = f"{data['kind']}: precision {data['from']} -> {data['to']}"
    verdict.events.append(alert_event(now, name, Severity.WARNING, summary, data, w.id, w.pool))
