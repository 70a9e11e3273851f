"""Health judgment on the control plane: turns workers' telemetry into directive changes and events.

Two entry points, both called by ``ControlPlane`` with the worker state it owns:

* ``on_beat`` — per heartbeat, under the worker's lock: the worker's circuit breaker (bandwidth and
  latency caps, memory ceiling), the precision guard and the stuck-episode detector. A decision made
  here rides back in the same heartbeat answer, so detection -> directive costs no extra round trip.
* ``periodic`` — from the reconcile loop: fleet comparison (robust statistics across peers of the same
  pool and role), pool-wide slowdowns, elastic memory quotas, precision restores.

The judgments themselves are the pure cores in ``dsec.breaker``, ``dsec.health`` and ``dsec.quota``;
this module only gathers their inputs from the hot state and formats their outputs as events.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dsec.alerts import Alert, AlertRouter, Severity
from dsec.breaker import Action, Breaker, BreakerConfig, Caps, Sample, Transition, fields_for
from dsec.control.worker_alerts import worker_alert
from dsec.health.fleet import FleetConfig, PeerSample, compare
from dsec.health.interventions import PrecisionGuard, agent_name, stuck_episode
from dsec.model import Event, EventType, Pool, PoolThresholds, WorkerState
from dsec.quota import PoolMemory, QuotaConfig, WorkerMemory, plan
from dsec.scheduler.device_health import SLOW_FEATURES

if TYPE_CHECKING:
    from dsec.control.state import HotState, LiveWorker

log = logging.getLogger(__name__)

SOURCE = "control_plane"  # data.source of the alert events the control plane raises


@dataclass(frozen=True)
class JudgeConfig:
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    quota: QuotaConfig = field(default_factory=QuotaConfig)
    fleet_interval_s: float = 1.0
    quota_interval_s: float = 2.0
    precision_fallback: Mapping[str, str] = field(default_factory=lambda: {"bf16": "fp16", "fp16": "fp32"})
    precision_stable_s: float = 300.0
    grad_spike_factor: float = 10.0


@dataclass
class Verdict:
    """What one beat changes: a directive patch (merged into one new version) and events to record."""

    patch: dict[str, Any] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)
    actors: list[str] = field(default_factory=list)
    breaker_issued: bool = False

    def add(self, actor: str, patch: Mapping[str, Any]) -> None:
        self.patch.update(patch)
        if actor not in self.actors:
            self.actors.append(actor)


@dataclass
class Change:
    """A periodic decision about one worker (applied through ``ControlPlane.set_directive``)."""

    worker_id: str
    patch: dict[str, Any]
    actor: str
    events: list[Event]


def _finite(metrics: Mapping[str, Any], key: str) -> float | None:
    v = metrics.get(key)
    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
        return float(v)
    return None


def sample_from(metrics: Mapping[str, Any], ts: float) -> Sample:
    """The breaker's signals from one beat's metrics. Latency is the per-step *cost* (lateness the group
    suffered because of this rank, see probe/ddp.py); plain sync latency when the cost is unknown."""
    upload = _finite(metrics, "grad_upload_bytes_per_s")
    latency = _finite(metrics, "sync_cost_ms_p50")
    if latency is None:
        latency = _finite(metrics, "sync_latency_ms_p50")
    return Sample(
        ts=ts,
        bandwidth_mbps=None if upload is None else upload / 1e6,
        latency_ms=latency,
        memory_gb=_finite(metrics, "memory_used_gb"),
    )


class Judge:
    def __init__(
        self,
        state: HotState,
        config: JudgeConfig | None = None,
        router: AlertRouter | None = None,
        forward_worker_alerts: bool = True,
    ) -> None:
        self.state = state
        self.config = config or JudgeConfig()
        self.router = router
        self.forward_worker_alerts = forward_worker_alerts
        self.breakers: dict[str, Breaker] = {}
        self.guards: dict[str, PrecisionGuard] = {}
        self.flags: dict[str, set[str]] = {}  # worker -> fleet features it is an outlier on
        # Workers the last fleet comparison could judge on speed (their role had enough peers reporting it).
        self.judged: set[str] = set()
        self.slow_pools: set[str] = set()
        self.pool_memory: dict[str, PoolMemory] = {}
        # Breaker levels recorded before a restart (from the durable breaker events), by worker.
        self.resume_levels: dict[str, int] = {}
        self._last_fleet = -math.inf
        self._last_quota = -math.inf

    # -- caps ------------------------------------------------------------------------------------------
    def caps_for(self, w: LiveWorker) -> Caps:
        pool = self.state.pools.get(w.pool)
        f = w.directive.fields
        th = pool.thresholds if pool else PoolThresholds()
        return Caps(
            bandwidth_mbps=f.bandwidth_cap_mbps or th.bandwidth_cap_mbps,
            latency_ms=f.latency_cap_ms or th.latency_cap_ms,
            memory_gb=f.memory_ceiling_gb or (pool.memory_ceiling_gb if pool else None),
        )

    def breaker(self, w: LiveWorker, now: float) -> Breaker:
        b = self.breakers.get(w.id)
        if b is None:
            # First sight of this worker (new, or after a control-plane restart): resume at the level the
            # last recorded breaker transition left it at (a manual directive is not a breaker level).
            level = self.resume_levels.pop(w.id, 0)
            b = self.breakers[w.id] = Breaker.resumed(self.config.breaker, level, now)
        return b

    def breaker_state(self, w: LiveWorker, now: float) -> dict[str, Any]:
        b = self.breakers.get(w.id)
        if b is None:  # not judged (yet, or any more): what it would resume at, without keeping it
            b = Breaker.resumed(self.config.breaker, self.resume_levels.get(w.id, 0), now)
        return b.to_dict()

    def forget(self, worker_id: str) -> None:
        for d in (self.breakers, self.guards, self.flags):
            d.pop(worker_id, None)
        self.judged.discard(worker_id)

    # -- per beat --------------------------------------------------------------------------------------
    def on_beat(
        self,
        w: LiveWorker,
        metrics: Mapping[str, Any],
        worker_events: Sequence[Event],
        acked_version: int,
        now: float,
    ) -> tuple[Verdict, Breaker | None]:
        """Decide for one beat. Returns the verdict and, when the breaker moved, its state before (to
        restore if the verdict cannot be committed)."""
        verdict = Verdict()
        b = self.breaker(w, now)
        caps = self.caps_for(w)
        if metrics:
            b.observe(sample_from(metrics, now), caps)
        t = b.decide(now, caps, acked_version)
        saved = None
        if t is not None:
            saved = b.undo()
            self._breaker_transition(w, t, caps, now, verdict)
        for ev in worker_events:
            if ev.type is EventType.ANOMALY:
                self._on_anomaly(w, ev, now, verdict)
        grad_norm = metrics.get("grad_norm") if metrics else None
        if isinstance(grad_norm, (int, float)) and not isinstance(grad_norm, bool):
            guard = self._guard(w)
            decision = guard.observe(float(grad_norm), w.directive.fields.precision, now)
            if decision is not None:
                self._precision(w, decision, now, verdict)
        return verdict, saved

    def issued(self, w: LiveWorker, verdict: Verdict, version: int, now: float) -> None:
        """The verdict's directive was committed as ``version``."""
        if verdict.breaker_issued:
            self.breakers[w.id].issued(version, now)

    def restore(self, w: LiveWorker, saved: Breaker | None) -> None:
        if saved is not None:
            self.breakers[w.id] = saved

    def _breaker_transition(self, w: LiveWorker, t: Transition, caps: Caps, now: float, verdict: Verdict) -> None:
        b = self.breakers[w.id]
        if t.action is not Action.NONE:
            patch = fields_for(t.level_after, b.causes, caps.memory_gb)
            verdict.add("breaker", patch)
            verdict.breaker_issued = True
        etype = EventType.MELTDOWN if t.meltdown else EventType.RECOVERED if t.after.value == "closed" else None
        data = {"kind": "breaker", **t.to_dict(), "caps": caps.limits()}
        verdict.events.append(Event(ts=now, type=etype or EventType.BREAKER, worker_id=w.id, pool=w.pool, data=data))
        if t.meltdown:
            causes = sorted(t.evidence.get("over", {}))
            self._alert(
                verdict.events,
                w,
                f"{self._agent(w)}_meltdown_{'_'.join(causes) or 'overload'}",
                Severity.WARNING,
                f"breaker opened on {', '.join(causes)}: degraded to level 1",
                data,
                now,
            )

    def _on_anomaly(self, w: LiveWorker, ev: Event, now: float, verdict: Verdict) -> None:
        kind = ev.data.get("kind")
        if kind == "episode_stuck":
            pool = self.state.pools.get(w.pool)
            if pool is None:
                return
            count = ev.data.get("count")
            d = stuck_episode(
                {**w.directive.fields.to_dict(), **verdict.patch},
                pool.memory_base_gb,
                pool.memory_ceiling_gb,
                self._agent(w),
                str(ev.data.get("reason") or "unknown"),
                int(count) if isinstance(count, int) else 0,
            )
            verdict.add("stuck_episode", d.patch)
            self._alert(verdict.events, w, d.alert, Severity.WARNING, "consecutive interrupted episodes", d.data, now)
        elif kind == "replica_drift":
            # DDP replicas that no longer hold the same weights train different models and average their
            # gradients: nothing downstream of this is trustworthy until they are made identical again.
            self._alert(
                verdict.events,
                w,
                f"{self._agent(w)}_replica_drift",
                Severity.CRITICAL,
                str(ev.data.get("message") or "replica parameters differ from the group's"),
                dict(ev.data),
                now,
            )
        elif kind == "non_finite_gradient":
            decision = self._guard(w).instability(
                "non_finite_gradient", w.directive.fields.precision, now, {"grad_norm": ev.data.get("grad_norm")}
            )
            if decision is not None:
                self._precision(w, decision, now, verdict)
            else:
                self._alert(
                    verdict.events,
                    w,
                    f"{self._agent(w)}_non_finite_gradient",
                    Severity.CRITICAL,
                    f"non-finite gradient at precision {w.directive.fields.precision}; no fallback configured",
                    dict(ev.data),
                    now,
                )

    def _guard(self, w: LiveWorker) -> PrecisionGuard:
        g = self.guards.get(w.id)
        if g is None:
            c = self.config
            g = self.guards[w.id] = PrecisionGuard(
                mapping=dict(c.precision_fallback), spike_factor=c.grad_spike_factor, stable_s=c.precision_stable_s
            )
        return g

    def _precision(
        self, w: LiveWorker, decision: tuple[dict[str, Any], dict[str, Any]], now: float, verdict: Verdict
    ) -> None:
        patch, data = decision
        verdict.add("precision_fallback", patch)
        name = f"{self._agent(w)}_precision_fallback_{data['from']}_to_{data['to']}"
        self._alert(
            verdict.events,
            w,
            name,
            Severity.WARNING,
            f"{data['kind']}: precision {data['from']} -> {data['to']}",
            data,
            now,
        )

    def _agent(self, w: LiveWorker) -> str:
        return agent_name(w.info.role.value, w.info.group, w.info.rank)

    def _alert(
        self,
        events: list[Event],
        w: LiveWorker | None,
        name: str,
        severity: Severity,
        summary: str,
        data: Mapping[str, Any],
        now: float,
        pool: str | None = None,
    ) -> None:
        ev = Event(
            ts=now,
            type=EventType.ALERT,
            worker_id=w.id if w else None,
            pool=w.pool if w else pool,
            # source last: data copied from a worker's event must not carry the worker's attribution (or a forged one)
            data={"name": name, "severity": severity.value, "summary": summary, **data, "source": SOURCE},
        )
        events.append(ev)

    def route(self, ev: Event) -> None:
        """Hand a recorded alert event to the sinks (after it was committed)."""
        if self.router is None or ev.type is not EventType.ALERT:
            return
        if ev.data.get("source") != SOURCE:  # a worker's alert event (stamped source=worker at ingest)
            if self.forward_worker_alerts:
                self.router.submit(worker_alert(ev))
            return
        data = dict(ev.data)
        data.pop("source", None)
        name = str(data.pop("name", None) or data.get("reason") or "worker_alert")
        raw = data.pop("severity", "warning")
        severity = Severity(raw) if raw in {s.value for s in Severity} else Severity.WARNING
        try:
            alert = Alert(
                name=name,
                severity=severity,
                ts=ev.ts,
                pool=ev.pool or None,
                worker_id=ev.worker_id or None,
                summary=str(data.pop("summary", "")),
                data=data,
            )
        except ValueError:
            log.warning("alert %r could not be routed", name, exc_info=True)
            return
        self.router.submit(alert)

    # -- periodic --------------------------------------------------------------------------------------
    def periodic(self, now: float) -> tuple[list[Change], list[Event]]:
        changes: list[Change] = []
        events: list[Event] = []
        if now - self._last_fleet >= self.config.fleet_interval_s:
            self._last_fleet = now
            self._fleet(now, events)
        if now - self._last_quota >= self.config.quota_interval_s:
            self._last_quota = now
            self._quotas(now, changes, events)
        self._precision_restores(now, changes)
        return changes, events

    def _active_by_pool(self) -> dict[str, list[LiveWorker]]:
        out: dict[str, list[LiveWorker]] = {}
        for w in list(self.state.workers.values()):
            if w.state is WorkerState.ACTIVE:
                out.setdefault(w.pool, []).append(w)
        return out

    def _fleet(self, now: float, events: list[Event]) -> None:
        judged: set[str] = set()
        for pool_name, ws in self._active_by_pool().items():
            samples = [
                PeerSample(w.id, w.info.role.value, w.info.group, self._features(w.metrics)) for w in ws if w.metrics
            ]
            report = compare(samples, self.config.fleet)
            flagged = report.outliers_by_worker()
            speed_roles = {
                st.role for st in report.stats if st.feature in SLOW_FEATURES and st.n >= self.config.fleet.min_peers
            }
            judged |= {s.worker_id for s in samples if s.role in speed_roles}
            for w in ws:
                now_flags = {o.feature: o for o in flagged.get(w.id, [])}
                before = self.flags.get(w.id, set())
                for feature in sorted(set(now_flags) - before):
                    o = now_flags[feature]
                    data = {
                        "kind": "fleet_outlier",
                        "feature": feature,
                        "value": o.value,
                        "median": o.median,
                        "mad": o.mad,
                        "z": o.z if math.isfinite(o.z) else None,
                        "peers": len(samples),
                    }
                    events.append(Event(ts=now, type=EventType.ANOMALY, worker_id=w.id, pool=pool_name, data=data))
                    self._alert(
                        events,
                        w,
                        f"{self._agent(w)}_straggler_{feature}",
                        Severity.WARNING,
                        f"{feature}={o.value:.4g} vs fleet median {o.median:.4g}",
                        data,
                        now,
                    )
                for feature in sorted(before - set(now_flags)):
                    events.append(
                        Event(
                            ts=now,
                            type=EventType.ANOMALY,
                            worker_id=w.id,
                            pool=pool_name,
                            data={"kind": "fleet_outlier_cleared", "feature": feature},
                        )
                    )
                self.flags[w.id] = set(now_flags)
            self._pool_slowdown(pool_name, ws, now, events)
        self.judged = judged

    @staticmethod
    def _features(metrics: Mapping[str, Any]) -> dict[str, float]:
        return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}

    def _pool_slowdown(self, pool_name: str, ws: list[LiveWorker], now: float, events: list[Event]) -> None:
        """Every peer over the latency cap at once is the pool's network or backend, not one bad worker:
        one pool-level alert (the breakers still degrade each worker over its cap)."""
        pool = self.state.pools.get(pool_name)
        if pool is None:
            return
        costs = [sample_from(w.metrics, now).latency_ms for w in ws]
        values = sorted(c for c in costs if c is not None)
        slow = len(values) >= self.config.fleet.min_peers and values[len(values) // 2] > pool.thresholds.latency_cap_ms
        if slow and pool_name not in self.slow_pools:
            median = values[len(values) // 2]
            self._alert(
                events,
                None,
                f"{pool_name}_pool_sync_slowdown",
                Severity.WARNING,
                f"median sync cost {median:.1f} ms over the pool's cap {pool.thresholds.latency_cap_ms:g} ms "
                f"on {sum(1 for v in values if v > pool.thresholds.latency_cap_ms)}/{len(values)} workers",
                {"median_ms": median, "cap_ms": pool.thresholds.latency_cap_ms, "workers": len(values)},
                now,
                pool=pool_name,
            )
            self.slow_pools.add(pool_name)
        elif not slow:
            self.slow_pools.discard(pool_name)

    def pool_capacity_gb(self, pool: Pool) -> float | None:
        total = sum(self.state.devices[d].memory_gb for d in pool.devices if d in self.state.devices)
        return total or None

    def _quotas(self, now: float, changes: list[Change], events: list[Event]) -> None:
        by_pool = self._active_by_pool()
        for pool in self.state.pools.values():
            ws = by_pool.get(pool.name, [])
            members = [
                WorkerMemory(
                    w.id,
                    _finite(w.metrics, "memory_used_gb"),
                    w.directive.fields.memory_quota_gb or pool.memory_base_gb,
                    w.directive.fields.memory_ceiling_gb,
                )
                for w in ws
            ]
            result = plan(
                self.pool_capacity_gb(pool), pool.memory_base_gb, pool.memory_ceiling_gb, members, self.config.quota
            )
            self.pool_memory[pool.name] = result.accounting
            for wid, quota in sorted(result.changes.items()):
                w = self.state.workers[wid]
                old = w.directive.fields.memory_quota_gb
                ev = Event(
                    ts=now,
                    type=EventType.QUOTA,
                    worker_id=wid,
                    pool=pool.name,
                    data={
                        "kind": "memory_quota",
                        "from_gb": old,
                        "to_gb": quota,
                        "reason": result.reasons.get(wid, ""),
                        "pool_memory": result.accounting.to_dict(),
                    },
                )
                changes.append(Change(wid, {"memory_quota_gb": quota}, "quota", [ev]))

    def _precision_restores(self, now: float, changes: list[Change]) -> None:
        for wid, guard in list(self.guards.items()):
            w = self.state.workers.get(wid)
            if w is None or guard.original is None:
                continue
            decision = guard.revert(w.directive.fields.precision, now)
            if decision is not None:
                patch, data = decision
                ev = Event(ts=now, type=EventType.RECOVERED, worker_id=wid, pool=w.pool, data=data)
                changes.append(Change(wid, patch, "precision_fallback", [ev]))
