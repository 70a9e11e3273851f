"""Exact contracts of the decision core: the payloads, texts and boundaries its verdicts carry.

test_decide.py checks which decisions are made; this file pins what they say (alert names and summaries, event
data, gauge values at their edges), found by mutation testing (docs/testing.md): each test here fails on a
mutant that survived before it.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from dsec.breaker import Action, Breaker, Caps, Phase, Transition, Trigger
from dsec.decide import (
    BeatInputs,
    PoolGauges,
    Verdict,
    WorkerGauges,
    WorkerView,
    caps_for,
    judge_beat,
    judge_pool,
    observe_memory,
    plan_pool_quotas,
    policy_samples,
    safe_latency_floor,
    slow_workers,
)
from dsec.decide.beat import BreakerMove, breaker_events
from dsec.decide.caps import finite, safe_latency_floors, sample_from
from dsec.decide.fleet import judged_workers
from dsec.decide.gauges import pool_gauges_of, pool_recovery_s, sync_success, utilization
from dsec.decide.quotas import precision_restore
from dsec.decide.verdicts import alert_event
from dsec.health.fleet import FleetConfig, Outlier, PeerSample, compare
from dsec.health.interventions import PrecisionGuard
from dsec.model import DirectiveFields, Event, EventType, Pool, PoolThresholds, WorkerState
from dsec.quota import MemoryTrend, PoolMemory, QuotaConfig

POOL = Pool("p", thresholds=PoolThresholds(bandwidth_cap_mbps=100.0, latency_cap_ms=50.0), memory_ceiling_gb=20.0)


def view(
    i: int = 0,
    role: str = "actor",
    metrics: dict[str, object] | None = None,
    state: WorkerState = WorkerState.ACTIVE,
    **fields: object,
) -> WorkerView:
    return WorkerView(f"w{i}", "p", role, "g", i, state, DirectiveFields(**fields), metrics or {})  # type: ignore[arg-type]


def beat(w: WorkerView, events: tuple[Event, ...] = (), pool: Pool | None = POOL, now: float = 7.0) -> BeatInputs:
    return BeatInputs(w, pool, caps_for(POOL.thresholds, POOL.memory_ceiling_gb, w.fields), w.metrics, events, 0, now)


def anomaly(**data: object) -> Event:
    return Event(ts=1.0, type=EventType.ANOMALY, data=data)


# -- caps: the breaker's signals and limits ----------------------------------------------------------------------
def test_finite_accepts_only_finite_non_bool_numbers() -> None:
    m = {"i": 3, "f": 2.5, "b": True, "nan": math.nan, "inf": math.inf, "s": "4"}
    assert finite(m, "i") == 3.0 and isinstance(finite(m, "i"), float)
    assert finite(m, "f") == 2.5
    assert [finite(m, k) for k in ("b", "nan", "inf", "s", "missing")] == [None] * 5


def test_sample_from_prefers_the_sync_cost_and_converts_bytes_to_megabytes() -> None:
    s = sample_from({"sync_cost_ms_p50": 12.0, "sync_latency_ms_p50": 90.0, "grad_upload_bytes_per_s": 2.5e6}, 4.0)
    assert (s.ts, s.latency_ms, s.bandwidth_mbps, s.memory_gb) == (4.0, 12.0, 2.5, None)
    fallback = sample_from({"sync_cost_ms_p50": math.nan, "sync_latency_ms_p50": 90.0, "memory_used_gb": 3}, 5.0)
    assert (fallback.latency_ms, fallback.bandwidth_mbps, fallback.memory_gb) == (90.0, None, 3.0)
    assert sample_from({}, 6.0) == type(s)(ts=6.0)


def test_caps_take_each_override_separately_and_a_floor_only_raises() -> None:
    own = DirectiveFields(bandwidth_cap_mbps=7.0)
    caps = caps_for(POOL.thresholds, 20.0, own, memory_pressure=0.5)
    assert caps.limits() == {"bandwidth_mbps": 7.0, "latency_ms": 50.0, "memory_gb": 10.0}
    assert caps_for(POOL.thresholds, 20.0, DirectiveFields(memory_ceiling_gb=8.0), 0.5).memory_gb == 4.0
    assert caps_for(POOL.thresholds, None, DirectiveFields()).memory_gb is None
    assert caps_for(POOL.thresholds, None, None, latency_floor_ms=10.0).latency_ms == 50.0  # never lowers the cap


def test_the_cap_safety_floor_starts_strictly_above_the_hysteresis_line() -> None:
    # the line: cap x (1 - margin) = 40 ms; a lower median exactly there is a pool that can still get calm
    assert safe_latency_floor([40.0, 40.0, 40.0], cap_ms=50.0, min_peers=3, margin=0.2) is None
    assert safe_latency_floor([40.5, 40.5, 40.5], cap_ms=50.0, min_peers=3, margin=0.2) == pytest.approx(60.75)
    # the lower median of an even count, unknown and non-finite costs not counted as peers
    costs = [41.0, None, 100.0, math.nan, 42.0, 200.0]
    assert safe_latency_floor(costs, cap_ms=50.0, min_peers=4, margin=0.2) == pytest.approx(1.5 * 42.0)
    assert safe_latency_floor(costs, cap_ms=50.0, min_peers=5, margin=0.2) is None
    assert safe_latency_floor([41.0, 42.0, 43.0], cap_ms=50.0, min_peers=3) == pytest.approx(63.0)  # margin 0.2


# -- per beat: breaker events -------------------------------------------------------------------------------------
def transition(before: Phase, after: Phase, level_before: int, level_after: int, meltdown: bool = False) -> Transition:
    action = Action.ESCALATE if level_after > level_before else Action.STEP_DOWN
    trigger = Trigger.OVERLOAD if level_after > level_before else Trigger.CALM
    evidence = {"over": {"sync": 1.0, "latency_ms": 0.9}} if meltdown else {"calm": True}
    return Transition(before, after, trigger, action, level_before, level_after, evidence, meltdown=meltdown)


def test_a_meltdown_is_one_event_and_one_warning_alert_naming_its_causes() -> None:
    w, caps = view(3), Caps(bandwidth_mbps=100.0, latency_ms=50.0, memory_gb=20.0)
    t = transition(Phase.CLOSED, Phase.ESCALATING, 0, 1, meltdown=True)
    ev, alert = breaker_events(w, BreakerMove(t, {"compression_bits": 4}), caps, 9.0)
    data = {"kind": "breaker", **t.to_dict(), "caps": caps.limits()}
    assert (ev.type, ev.ts, ev.worker_id, ev.pool, ev.data) == (EventType.MELTDOWN, 9.0, "w3", "p", data)
    assert (alert.type, alert.ts, alert.worker_id, alert.pool) == (EventType.ALERT, 9.0, "w3", "p")
    assert alert.data == {
        "name": f"{w.agent}_meltdown_latency_ms_sync",
        "severity": "warning",
        "summary": "breaker opened on latency_ms, sync: degraded to level 1",
        **data,
        "source": "control_plane",
    }


def test_a_meltdown_without_named_causes_is_an_overload_alert() -> None:
    t = Transition(Phase.CLOSED, Phase.ESCALATING, Trigger.OVERLOAD, Action.ESCALATE, 0, 1, {}, meltdown=True)
    _, alert = breaker_events(view(), BreakerMove(t, None), Caps(), 1.0)
    assert alert.data["name"] == f"{view().agent}_meltdown_overload"
    assert alert.data["summary"] == "breaker opened on : degraded to level 1"


def test_a_step_back_to_closed_is_recovered_and_other_moves_are_breaker_events_without_alerts() -> None:
    caps = Caps()
    recovered = breaker_events(view(), BreakerMove(transition(Phase.HALF_OPEN, Phase.CLOSED, 1, 0), None), caps, 2.0)
    assert [e.type for e in recovered] == [EventType.RECOVERED]
    assert recovered[0].data["to"] == "closed" and recovered[0].data["kind"] == "breaker"
    deeper = breaker_events(view(), BreakerMove(transition(Phase.OPEN, Phase.ESCALATING, 1, 2), {"x": 1}), caps, 3.0)
    assert [e.type for e in deeper] == [EventType.BREAKER] and deeper[0].data["caps"] == caps.limits()
    down = breaker_events(view(), BreakerMove(transition(Phase.OPEN, Phase.RECOVERING, 2, 1), None), caps, 3.0)
    assert [e.type for e in down] == [EventType.BREAKER]


# -- per beat: anomalies --------------------------------------------------------------------------------------------
def test_a_stuck_episode_lowers_ceiling_and_priority_and_alerts_with_its_reason_and_count() -> None:
    w = view(2)
    v = judge_beat(beat(w, (anomaly(kind="episode_stuck", reason="oom kill", count=5),)), Breaker(), PrecisionGuard())
    assert v.patch == {"sync_priority": -1, "memory_ceiling_gb": 19.0} and v.actors == ["stuck_episode"]
    (alert,) = v.events
    assert (alert.type, alert.ts, alert.worker_id, alert.pool) == (EventType.ALERT, 7.0, "w2", "p")
    assert alert.data == {
        "name": f"{w.agent}_episode_stuck_oom_kill_5x",
        "severity": "warning",
        "summary": "consecutive interrupted episodes",
        "reason": "oom kill",
        "count": 5,
        "memory_ceiling_gb": [20.0, 19.0],
        "sync_priority": [0, -1],
        "source": "control_plane",
    }


def test_stuck_episodes_in_one_beat_build_on_each_other_and_bad_counts_read_as_zero() -> None:
    stuck = anomaly(kind="episode_stuck", count="5")  # a string count, no reason
    v = judge_beat(beat(view(), (stuck, stuck)), Breaker(), PrecisionGuard())
    assert v.patch == {"sync_priority": -2, "memory_ceiling_gb": 18.0}
    assert [e.data["name"] for e in v.events] == [f"{view().agent}_episode_stuck_unknown_0x"] * 2
    assert [e.data["reason"] for e in v.events] == ["unknown"] * 2


def test_a_stuck_episode_without_a_known_pool_decides_nothing() -> None:
    v = judge_beat(beat(view(), (anomaly(kind="episode_stuck", count=3),), pool=None), Breaker(), PrecisionGuard())
    assert (v.patch, v.events, v.actors) == ({}, [], [])


def test_replica_drift_is_a_critical_alert_carrying_the_workers_data_but_dsecs_attribution() -> None:
    w = view(1)
    plain = judge_beat(beat(w, (anomaly(kind="replica_drift", step=40, source="forged"),)), Breaker(), PrecisionGuard())
    assert plain.patch == {} and plain.actors == []
    assert plain.events[0].data == {
        "name": f"{w.agent}_replica_drift",
        "severity": "critical",
        "summary": "replica parameters differ from the group's",
        "kind": "replica_drift",
        "step": 40,
        "source": "control_plane",
    }
    said = judge_beat(beat(w, (anomaly(kind="replica_drift", message="rank 1 differs"),)), Breaker(), PrecisionGuard())
    assert said.events[0].data["summary"] == "rank 1 differs"


def test_a_non_finite_gradient_falls_back_one_precision_step_with_a_warning() -> None:
    w = view(4, precision="bf16")
    v = judge_beat(beat(w, (anomaly(kind="non_finite_gradient", grad_norm="inf"),)), Breaker(), PrecisionGuard())
    assert v.patch == {"precision": "fp16"} and v.actors == ["precision_fallback"]
    assert v.events[0].data == {
        "name": f"{w.agent}_precision_fallback_bf16_to_fp16",
        "severity": "warning",
        "summary": "non_finite_gradient: precision bf16 -> fp16",
        "kind": "non_finite_gradient",
        "from": "bf16",
        "to": "fp16",
        "grad_norm": "inf",
        "source": "control_plane",
    }


def test_a_non_finite_gradient_with_nothing_to_fall_back_to_is_critical() -> None:
    w = view(4, precision="fp32")
    v = judge_beat(beat(w, (anomaly(kind="non_finite_gradient", grad_norm="nan"),)), Breaker(), PrecisionGuard())
    assert v.patch == {} and v.actors == []
    assert v.events[0].data == {
        "name": f"{w.agent}_non_finite_gradient",
        "severity": "critical",
        "summary": "non-finite gradient at precision fp32; no fallback configured",
        "kind": "non_finite_gradient",
        "grad_norm": "nan",
        "source": "control_plane",
    }


def test_only_anomaly_events_of_known_kinds_are_judged() -> None:
    drift_as_other = Event(ts=1.0, type=EventType.SNAPSHOT, data={"kind": "replica_drift"})
    unknown = anomaly(kind="fleet_outlier")
    v = judge_beat(beat(view(), (drift_as_other, unknown)), Breaker(), PrecisionGuard())
    assert (v.patch, v.events) == ({}, [])


def test_a_gradient_norm_spike_falls_back_but_a_boolean_norm_is_no_sample() -> None:
    guard = PrecisionGuard(min_history=3)
    w = view(precision="bf16", metrics={"grad_norm": 1.0})
    for _ in range(3):
        assert judge_beat(beat(w), Breaker(), guard).patch == {}
    assert judge_beat(beat(view(precision="bf16", metrics={"grad_norm": True})), Breaker(), guard).patch == {}
    assert len(guard._norms) == 3
    spike = judge_beat(beat(view(precision="bf16", metrics={"grad_norm": 50.0})), Breaker(), guard)
    assert spike.patch == {"precision": "fp16"}
    assert spike.events[0].data["summary"] == "grad_norm_spike: precision bf16 -> fp16"


def test_a_verdict_merges_patches_and_names_each_actor_once() -> None:
    v = Verdict()
    v.add("breaker", {"compression_bits": 4})
    v.add("quota", {"memory_quota_gb": 8.0})
    v.add("breaker", {"compression_bits": 8, "grad_accum_steps": 4})
    assert v.patch == {"compression_bits": 8, "memory_quota_gb": 8.0, "grad_accum_steps": 4}
    assert v.actors == ["breaker", "quota"] and not v.breaker_issued and not v.breaker_moved


def test_an_alert_event_carries_dsecs_source_over_any_in_its_data() -> None:
    from dsec.alerts.model import Severity

    e = alert_event(3.0, "n", Severity.INFO, "s", {"source": "worker", "x": 1})
    assert (e.type, e.ts, e.worker_id, e.pool) == (EventType.ALERT, 3.0, None, None)
    assert e.data == {"name": "n", "severity": "info", "summary": "s", "x": 1, "source": "control_plane"}


# -- fleet -----------------------------------------------------------------------------------------------------------
def test_an_outlier_is_an_anomaly_and_a_straggler_alert_with_its_statistics() -> None:
    ws = [view(i, metrics={"step_ms_mean": 100.0 + i}) for i in range(4)] + [view(4, metrics={"step_ms_mean": 900.0})]
    v = judge_pool(POOL, "p", ws, {}, False, FleetConfig(), 10.0)
    anomaly_ev, alert = v.events
    o = anomaly_ev.data
    assert (anomaly_ev.type, anomaly_ev.ts, anomaly_ev.worker_id, anomaly_ev.pool) == (
        EventType.ANOMALY,
        10.0,
        "w4",
        "p",
    )
    assert set(o) == {"kind", "feature", "value", "median", "mad", "z", "peers"}
    assert (o["kind"], o["feature"], o["value"], o["median"], o["peers"]) == (
        "fleet_outlier",
        "step_ms_mean",
        900.0,
        102.0,
        5,
    )
    assert o["mad"] == pytest.approx(1.4826) and o["z"] > 0
    assert alert.data["summary"] == "step_ms_mean=900 vs fleet median 102"
    assert alert.data["severity"] == "warning" and alert.data["z"] == o["z"]
    assert v.events[1].worker_id == "w4" and v.events[1].pool == "p"


def test_an_outlier_with_an_infinite_score_reports_no_z() -> None:
    from dsec.decide.fleet import _outlier_events

    o = Outlier("w0", "actor", "step_ms_mean", 5.0, 1.0, 0.0, math.inf)
    assert _outlier_events(view(), o, 3, 1.0)[0].data["z"] is None


def test_judged_workers_are_those_of_a_role_with_enough_peers_on_a_speed_feature() -> None:
    cfg = FleetConfig()
    speed = [PeerSample(f"a{i}", "actor", "g", {"step_ms_mean": 1.0}) for i in range(cfg.min_peers)]
    few = [PeerSample(f"l{i}", "learner", "g", {"step_ms_mean": 1.0}) for i in range(cfg.min_peers - 1)]
    other = [PeerSample(f"m{i}", "mem", "g", {"memory_used_gb": 1.0}) for i in range(cfg.min_peers)]
    samples = speed + few + other
    assert judged_workers(samples, compare(samples, cfg), cfg) == {s.worker_id for s in speed}


def test_slow_workers_count_only_speed_features_given_as_names_or_outliers() -> None:
    o = Outlier("w1", "actor", "step_ms_mean", 5.0, 1.0, 0.5, 8.0)
    m = Outlier("w2", "actor", "memory_used_gb", 5.0, 1.0, 0.5, 8.0)
    assert slow_workers({"w1": [o], "w2": [m]}) == {"w1"}
    assert slow_workers({"w1": {"memory_used_gb"}, "w3": {"step_ms_mean", "x"}}) == {"w3"}


def test_a_slow_pool_takes_the_upper_median_and_must_be_strictly_over_the_cap() -> None:
    cfg = FleetConfig()
    n = max(cfg.min_peers, 4)
    at_cap = [view(i, metrics={"sync_latency_ms_p50": 50.0}) for i in range(n)]
    assert not judge_pool(POOL, "p", at_cap, {}, False, cfg, 1.0).slow_pool
    # half the peers at 40, half at 80: the upper median (80) is over the cap, the lower (40) is not
    half = [view(i, metrics={"sync_latency_ms_p50": 40.0 if i < n // 2 else 80.0}) for i in range(2 * (n // 2))]
    v = judge_pool(POOL, "p", half, {}, False, cfg, 1.0)
    assert v.slow_pool
    (alert,) = [e for e in v.events if e.type is EventType.ALERT]
    assert (alert.worker_id, alert.pool, alert.ts) == (None, "p", 1.0)
    k = 2 * (n // 2)
    assert alert.data["summary"] == f"median sync cost 80.0 ms over the pool's cap 50 ms on {k // 2}/{k} workers"
    assert (alert.data["median_ms"], alert.data["cap_ms"], alert.data["workers"]) == (80.0, 50.0, k)
    too_few = [view(i, metrics={"sync_latency_ms_p50": 90.0}) for i in range(cfg.min_peers - 1)]
    assert not judge_pool(POOL, "p", too_few, {}, False, cfg, 1.0).slow_pool


def test_a_pool_without_its_record_is_judged_for_outliers_only() -> None:
    ws = [view(i, metrics={"sync_latency_ms_p50": 400.0}) for i in range(5)]
    v = judge_pool(None, "p", ws, {}, False, FleetConfig(), 1.0)
    assert not v.slow_pool and v.latency_floor_ms is None and v.events == []


def test_workers_without_metrics_are_not_compared_but_their_flags_clear() -> None:
    ws = [view(i, metrics={"step_ms_mean": 100.0}) for i in range(4)] + [view(4)]
    v = judge_pool(POOL, "p", ws, {"w4": {"step_ms_mean"}}, False, FleetConfig(), 5.0)
    assert v.flags["w4"] == set()
    (cleared,) = v.events
    assert (cleared.type, cleared.worker_id, cleared.pool, cleared.ts) == (EventType.ANOMALY, "w4", "p", 5.0)
    assert cleared.data == {"kind": "fleet_outlier_cleared", "feature": "step_ms_mean"}


# -- gauges ----------------------------------------------------------------------------------------------------------
def test_utilization_and_sync_success_at_their_edges() -> None:
    assert utilization([]) == 0.0 and utilization([0.5, 1.0]) == 0.75
    assert sync_success(3.0, 4.0) == 0.75 and math.isnan(sync_success(0.0, 0.0)) and sync_success(0.0, 2.0) == 0.0


def test_the_pool_recovery_time_waits_for_enough_distinct_reporters_and_takes_the_lower_median() -> None:
    assert math.isnan(pool_recovery_s({}, active_workers=5, min_reporters=2))
    assert math.isnan(pool_recovery_s({"a": 9999.0}, active_workers=5, min_reporters=2))
    assert pool_recovery_s({"a": 9999.0, "b": 1.0}, active_workers=5, min_reporters=2) == 1.0
    assert pool_recovery_s({"a": 3.0, "b": 1.0, "c": 2.0}, active_workers=5, min_reporters=2) == 2.0
    assert pool_recovery_s({"a": 4.0}, active_workers=1, min_reporters=2) == 4.0  # a one-worker pool
    assert pool_recovery_s({"a": 4.0}, active_workers=0, min_reporters=2) == 4.0


def test_pool_gauges_from_workers_in_every_state() -> None:
    workers = [
        view(0, metrics={"memory_used_gb": 4.0, "sync_ok_total": 9.0, "sync_ops_total": 10.0}, memory_quota_gb=8.0),
        view(1, metrics={"memory_used_gb": 6.0, "sync_ok_total": 10.0, "sync_ops_total": 10.0}, memory_quota_gb=6.0),
        view(2, metrics={"memory_used_gb": 5.0}),  # no quota: not in the utilization
        view(
            3,
            metrics={"memory_used_gb": 1.0, "sync_ok_total": 0.0, "sync_ops_total": 20.0},
            memory_quota_gb=1.0,
            state=WorkerState.LOST,
        ),
    ]
    memory = PoolMemory(40.0, 15.0, 16.0, None, 7.0, 12.0, 4)
    g = pool_gauges_of(workers, 2, 3, {"w0": 1.5, "w1": 2.5}, 2, memory)
    assert g.utilization == pytest.approx((0.5 + 1.0) / 2)
    assert g.sync_success == pytest.approx(19.0 / 40.0)  # a lost worker's syncs still count
    assert g.recovery_s == 1.5 and g.meltdowns == 3.0 and isinstance(g.meltdowns, float) and g.pending == 2
    assert g.workers[WorkerState.ACTIVE] == 3 and g.workers[WorkerState.LOST] == 1
    assert set(g.workers) == set(WorkerState) and sum(g.workers.values()) == 4
    assert g.memory == {"capacity": 40.0, "granted": 15.0, "used": 16.0}
    unknown = pool_gauges_of(workers, 0, 0, {}, 2, PoolMemory(None, 15.0, 16.0, None, 7.0, 12.0, 4))
    assert unknown.memory == {"granted": 15.0, "used": 16.0} and math.isnan(unknown.recovery_s)
    assert pool_gauges_of([], 0, 0, {}, 2, None).memory == {}


def test_policy_samples_name_every_pool_and_active_worker_gauge() -> None:
    g = PoolGauges(0.5, 0.99, 2.0, 3.0, {WorkerState.ACTIVE: 3, WorkerState.LOST: 1}, 4, {"used": 4.0, "granted": 6.0})
    workers = [WorkerGauges("p", "w0", "actor", True, 1.0, 2.0), WorkerGauges("p", "w1", "actor", False, 5.0, 3.0)]
    assert policy_samples({"p": g}, workers) == {
        ("dsec_sandbox_utilization_rate", "p", None): 0.5,
        ("dsec_gradient_sync_success_rate", "p", None): 0.99,
        ("dsec_snapshot_recovery_time", "p", None): 2.0,
        ("dsec_melt_down_count", "p", None): 3.0,
        ("dsec_directives_pending", "p", None): 4.0,
        ("dsec_workers_active", "p", None): 3.0,
        ("dsec_workers_lost", "p", None): 1.0,
        ("dsec_pool_memory_used_gb", "p", None): 4.0,
        ("dsec_pool_memory_granted_gb", "p", None): 6.0,
        ("dsec_worker_melt_down_count", "p", "w0"): 1.0,
        ("dsec_breaker_level", "p", "w0"): 2.0,
    }
    empty = PoolGauges(0.0, math.nan, math.nan, 0.0, {}, 0)
    assert policy_samples({"q": empty})[("dsec_workers_active", "q", None)] == 0.0


# -- periodic: quotas and precision restores --------------------------------------------------------------------------
def test_a_quota_event_says_from_to_limit_reason_and_the_pools_accounting() -> None:
    pool = Pool("p", memory_base_gb=8.0, memory_ceiling_gb=16.0)
    ws = [view(0, metrics={"memory_used_gb": 7.9}, memory_quota_gb=8.0, memory_limit_gb=12.0)]
    v = plan_pool_quotas(pool, 40.0, ws, QuotaConfig(), 3.0, device_gb=20.0)
    (change,) = v.changes
    ev = change.events[0]
    assert (ev.type, ev.ts, ev.worker_id, ev.pool) == (EventType.QUOTA, 3.0, "w0", "p")
    d = ev.data
    assert d["kind"] == "memory_quota" and d["from_gb"] == 8.0 and d["to_gb"] == change.patch["memory_quota_gb"]
    assert d["limit_from_gb"] == 12.0 and d["limit_to_gb"] == change.patch["memory_limit_gb"]
    assert isinstance(d["reason"], str) and d["reason"]
    assert d["pool_memory"] == v.accounting.to_dict() and d["pool_memory"]["workers"] == 1


def test_a_limit_change_alone_keeps_the_grant_in_its_event() -> None:
    pool = Pool("p", memory_base_gb=8.0, memory_ceiling_gb=16.0)
    ws = [view(0, metrics={"memory_used_gb": 1.0}, memory_quota_gb=8.0)]
    (change,) = plan_pool_quotas(pool, 40.0, ws, QuotaConfig(), 3.0, device_gb=20.0).changes
    assert change.patch == {"memory_limit_gb": 16.0}
    assert (change.events[0].data["from_gb"], change.events[0].data["to_gb"]) == (8.0, 8.0)
    assert change.events[0].data["limit_from_gb"] is None


def test_a_worker_without_a_grant_is_planned_from_the_pools_base() -> None:
    pool = Pool("p", memory_base_gb=8.0, memory_ceiling_gb=16.0)
    busy = [view(0, metrics={"memory_used_gb": 7.9})]  # no memory_quota_gb yet: the base is its grant
    (change,) = plan_pool_quotas(pool, 40.0, busy, QuotaConfig(), 3.0).changes
    assert change.patch["memory_quota_gb"] > 8.0 and change.events[0].data["from_gb"] is None


def test_memory_trends_keep_a_silent_workers_trend_and_start_a_new_ones() -> None:
    old = MemoryTrend.first(3.0, 0.0)
    out = observe_memory({"w0": old}, [view(0), view(1, metrics={"memory_used_gb": 2.0})], 5.0)
    assert out["w0"] is old and out["w1"] == MemoryTrend.first(2.0, 5.0)
    assert observe_memory({}, [view(0, metrics={"memory_used_gb": True})], 5.0) == {}


def test_a_precision_restore_waits_for_stability_and_returns_the_original() -> None:
    w = view(5, precision="fp16")
    guard = PrecisionGuard(stable_s=60.0)
    assert precision_restore(w, guard, 0.0) is None  # no fallback happened
    assert guard.instability("non_finite_gradient", "bf16", 100.0, {}) is not None
    assert precision_restore(w, guard, 159.0) is None and guard.original == "bf16"
    change = precision_restore(w, guard, 160.0)
    assert change is not None
    assert (change.worker_id, change.patch, change.actor) == ("w5", {"precision": "bf16"}, "precision_fallback")
    (ev,) = change.events
    assert (ev.type, ev.ts, ev.worker_id, ev.pool) == (EventType.RECOVERED, 160.0, "w5", "p")
    assert ev.data == {"kind": "precision_restored", "from": "fp16", "to": "bf16", "stable_s": 60.0}
    assert precision_restore(w, guard, 500.0) is None  # restored once


# -- survivors of the first mutation run over this file (docs/testing.md) ----------------------------------------------
def envelope(e: Event) -> tuple[object, ...]:
    return (e.ts, e.worker_id, e.pool)


def test_every_alert_a_beat_raises_is_dated_and_attributed_to_its_worker() -> None:
    drift = judge_beat(beat(view(1), (anomaly(kind="replica_drift"),)), Breaker(), PrecisionGuard())
    assert [envelope(e) for e in drift.events] == [(7.0, "w1", "p")]
    guard = PrecisionGuard()
    nan = judge_beat(beat(view(1, precision="bf16"), (anomaly(kind="non_finite_gradient"),)), Breaker(), guard)
    assert [envelope(e) for e in nan.events] == [(7.0, "w1", "p")] and guard.last_instability == 7.0
    guard = PrecisionGuard()
    none = judge_beat(beat(view(1, precision="fp32"), (anomaly(kind="non_finite_gradient"),)), Breaker(), guard)
    assert [envelope(e) for e in none.events] == [(7.0, "w1", "p")] and guard.last_instability == 7.0


def test_a_spike_is_dated_by_the_beat_in_the_guard_and_the_alert() -> None:
    guard = PrecisionGuard(min_history=3)
    for t in range(3):
        judge_beat(beat(view(precision="bf16", metrics={"grad_norm": 1.0}), now=float(t)), Breaker(), guard)
    spike = judge_beat(beat(view(precision="bf16", metrics={"grad_norm": 50.0}), now=9.0), Breaker(), guard)
    assert guard.last_instability == 9.0 and [envelope(e) for e in spike.events] == [(9.0, "w0", "p")]


def test_an_ack_of_the_breakers_directive_is_a_move_without_a_patch() -> None:
    from dsec.breaker import BreakerConfig

    breaker = Breaker(BreakerConfig(window_s=10.0, min_samples=3))
    w = view(metrics={"sync_latency_ms_p50": 200.0})
    for t in range(3):
        v = judge_beat(beat(w, now=float(t)), breaker, PrecisionGuard())
    assert v.breaker_issued
    breaker.issued(5, 2.0)
    acked = BeatInputs(w, POOL, beat(w).caps, {}, (), 5, 3.0)
    v = judge_beat(acked, breaker, PrecisionGuard())
    assert v.breaker_moved and not v.breaker_issued and v.patch == {} and v.actors == []
    assert [(e.type, e.data["trigger"], e.data["action"]) for e in v.events] == [(EventType.BREAKER, "acked", "none")]
    assert breaker.awaiting_version is None


def test_a_memory_meltdown_caps_the_grant_at_the_memory_cap_where_the_memory_path_is_on() -> None:
    from dsec.breaker import BreakerConfig

    breaker = Breaker(BreakerConfig(window_s=10.0, min_samples=3))
    w = view(metrics={"memory_used_gb": 25.0})
    caps = caps_for(POOL.thresholds, POOL.memory_ceiling_gb, w.fields, memory_pressure=1.0)
    for t in range(3):
        v = judge_beat(BeatInputs(w, POOL, caps, w.metrics, (), 0, float(t)), breaker, PrecisionGuard())
    assert v.breaker_issued and v.patch["memory_quota_gb"] == 20.0 and v.patch["grad_accum_steps"] >= 4
    # As shipped (no memory path) the same usage degrades nothing: the quota's limit and the drain handle memory.
    off = Breaker(BreakerConfig(window_s=10.0, min_samples=3))
    for t in range(3):
        v = judge_beat(beat(w, now=float(t)), off, PrecisionGuard())
    assert not v.breaker_issued and v.patch == {}


def test_quota_planning_uses_the_given_config() -> None:
    pool = Pool("p", memory_base_gb=8.0, memory_ceiling_gb=16.0)
    ws = [view(0, metrics={"memory_used_gb": 7.9}, memory_quota_gb=8.0, memory_limit_gb=16.0)]
    assert plan_pool_quotas(pool, 40.0, ws, QuotaConfig(), 3.0).changes  # 7.9 / 8 is past the default 0.85
    late = QuotaConfig(grow_when_used_fraction=0.99)
    assert [c.patch for c in plan_pool_quotas(pool, 40.0, ws, late, 3.0).changes] == []


def test_a_limit_is_bounded_by_one_devices_memory_and_the_workers_own_ceiling() -> None:
    roomy = Pool("p", memory_base_gb=8.0, memory_ceiling_gb=30.0)
    ws = [view(0, metrics={"memory_used_gb": 7.0}, memory_quota_gb=8.0)]
    (change,) = plan_pool_quotas(roomy, 40.0, ws, QuotaConfig(), 3.0, device_gb=20.0).changes
    assert change.patch["memory_limit_gb"] == 20.0  # not the pool's 40 GB of two cards
    own = [view(0, metrics={"memory_used_gb": 7.0}, memory_quota_gb=8.0, memory_ceiling_gb=10.0)]
    (change,) = plan_pool_quotas(roomy, 40.0, own, QuotaConfig(), 3.0, device_gb=20.0).changes
    assert change.patch["memory_limit_gb"] == 10.0


def test_only_a_burst_runs_a_limit_past_the_ceiling_and_an_idle_grant_comes_back() -> None:
    pool = Pool("p", memory_base_gb=8.0, memory_ceiling_gb=16.0)
    ws = [view(0, metrics={"memory_used_gb": 15.0}, memory_quota_gb=16.0)]
    calm = plan_pool_quotas(pool, 40.0, ws, QuotaConfig(), 3.0, device_gb=20.0).changes
    assert calm[0].patch["memory_limit_gb"] == 16.0
    burst = {"w0": MemoryTrend(t=3.0, used_gb=15.0, ramp_gb_per_s=1.0, peak_gb=15.0, peak_t=3.0, burst_t=3.0)}
    bursting = plan_pool_quotas(pool, 40.0, ws, QuotaConfig(), 3.0, trends=burst, device_gb=20.0).changes
    assert bursting[0].patch["memory_limit_gb"] == 20.0
    idle = [view(0, metrics={"memory_used_gb": 2.0}, memory_quota_gb=14.0, memory_limit_gb=14.0)]
    trend = {"w0": MemoryTrend.first(2.0, 0.0)}
    (change,) = plan_pool_quotas(pool, 40.0, idle, QuotaConfig(), 3.0, trends=trend).changes
    assert change.patch["memory_quota_gb"] == 8.0 and "idle grant reclaimed" in change.events[0].data["reason"]
    no_trend = plan_pool_quotas(pool, 40.0, idle, QuotaConfig(), 3.0).changes  # no peak to judge the grant by
    assert all("memory_quota_gb" not in c.patch for c in no_trend)


def test_a_burst_runs_past_the_pools_ceiling_that_every_worker_registers_with() -> None:
    # Registration gives every worker the pool's ceiling in its fields (DirectiveFields.for_pool): that is no
    # ceiling of its own, so a burst still runs into free memory; one lowered for the worker stays a hard bound.
    pool = Pool("p", memory_base_gb=8.0, memory_ceiling_gb=16.0)
    burst = {"w0": MemoryTrend(t=3.0, used_gb=15.0, ramp_gb_per_s=1.0, peak_gb=15.0, peak_t=3.0, burst_t=3.0)}
    fields = DirectiveFields.for_pool(pool)
    assert fields.memory_ceiling_gb == 16.0
    ws = [view(0, metrics={"memory_used_gb": 15.0}, memory_quota_gb=16.0, memory_ceiling_gb=16.0)]
    (change,) = plan_pool_quotas(pool, 40.0, ws, QuotaConfig(), 3.0, trends=burst, device_gb=20.0).changes
    assert change.patch["memory_limit_gb"] == 20.0
    lowered = [view(0, metrics={"memory_used_gb": 15.0}, memory_quota_gb=14.0, memory_ceiling_gb=14.0)]
    (change,) = plan_pool_quotas(pool, 40.0, lowered, QuotaConfig(), 3.0, trends=burst, device_gb=20.0).changes
    assert change.patch["memory_limit_gb"] == 14.0


def on(device: str, w: WorkerView) -> WorkerView:
    return w._replace(device=device)


def test_a_bursts_limit_is_what_its_card_mates_leave_free_not_what_the_pool_has() -> None:
    # Two 80 GB cards: w0 bursts on d0 beside w1, who holds 25 GB there; w2 on d1 holds 10. The pool has 75 GB free,
    # d0 only 5 past w0's 50: its limit is 80 - 25 = 55 (the pool-wide rule gave the whole card, 80, so w0 could
    # take what w1 holds and w1's next allocation would fail instead).
    pool = Pool("p", devices=("d0", "d1"), memory_base_gb=8.0, memory_ceiling_gb=16.0)
    burst = {"w0": MemoryTrend(t=3.0, used_gb=50.0, ramp_gb_per_s=1.0, peak_gb=50.0, peak_t=3.0, burst_t=3.0)}
    ws = [
        on("d0", view(0, metrics={"memory_used_gb": 50.0}, memory_quota_gb=16.0, memory_limit_gb=50.0)),
        on("d0", view(1, metrics={"memory_used_gb": 25.0}, memory_quota_gb=16.0, memory_limit_gb=16.0)),
        on("d1", view(2, metrics={"memory_used_gb": 10.0}, memory_quota_gb=16.0, memory_limit_gb=16.0)),
    ]
    cards = {"d0": ("d0", 80.0), "d1": ("d1", 80.0)}
    v = plan_pool_quotas(pool, 160.0, ws, QuotaConfig(), 3.0, trends=burst, device_gb=80.0, cards=cards)
    (change,) = [c for c in v.changes if c.worker_id == "w0"]
    assert change.patch["memory_limit_gb"] == 55.0
    data = change.events[0].data
    assert data["card"] == "d0" and data["card_memory"]["capacity_gb"] == 80.0
    assert data["pool_memory"]["capacity_gb"] == 160.0 and data["pool_memory"]["workers"] == 3
    assert v.accounting.used_gb == 85.0 and v.accounting.workers == 3


def test_grants_on_one_card_add_up_to_that_card_not_to_the_pool() -> None:
    # Four workers on d0 (20 GB), each using 4.6 GB of a 4 GB grant, want to grow to the 8 GB ceiling; d1 (20 GB)
    # holds none of them. Granted on d0 may not pass 20 GB (the pool-wide rule granted 4 x 8 = 32 of the pool's 40).
    pool = Pool("p", devices=("d0", "d1"), memory_base_gb=4.0, memory_ceiling_gb=8.0)
    ws = [on("d0", view(i, metrics={"memory_used_gb": 4.6}, memory_quota_gb=4.0)) for i in range(4)]
    cards = {"d0": ("d0", 20.0), "d1": ("d1", 20.0)}
    v = plan_pool_quotas(pool, 40.0, ws, QuotaConfig(), 3.0, device_gb=20.0, cards=cards)
    grants = [c.patch.get("memory_quota_gb", 4.0) for c in v.changes]
    assert len(grants) == 4 and sum(grants) <= 20.0 + 1e-9 and max(grants) > 4.0
    assert v.accounting.granted_gb <= 20.0 + 1e-9 and v.accounting.capacity_gb == 40.0
    # Without a device, as before: the pool's capacity is what they share.
    loose = plan_pool_quotas(pool, 40.0, [w._replace(device=None) for w in ws], QuotaConfig(), 3.0,
                             device_gb=20.0, cards=cards)  # fmt: skip
    assert loose.accounting.granted_gb > 20.0


def test_workers_of_unknown_device_share_what_the_pools_known_devices_leave() -> None:
    # w0 on d0 (known, 20 GB) is planned alone; w1 reports no device and w2 a device nobody registered: they share
    # the pool's 40 GB less d0's 20, so their limits stop at 20 - what the other holds.
    pool = Pool("p", devices=("d0", "d1"), memory_base_gb=4.0, memory_ceiling_gb=8.0)
    burst = {
        f"w{i}": MemoryTrend(t=3.0, used_gb=6.0, ramp_gb_per_s=1.0, peak_gb=6.0, peak_t=3.0, burst_t=3.0)
        for i in range(3)
    }
    ws = [
        on("d0", view(0, metrics={"memory_used_gb": 6.0}, memory_quota_gb=8.0, memory_limit_gb=8.0)),
        view(1, metrics={"memory_used_gb": 6.0}, memory_quota_gb=8.0, memory_limit_gb=8.0),
        on("elsewhere", view(2, metrics={"memory_used_gb": 6.0}, memory_quota_gb=8.0, memory_limit_gb=8.0)),
    ]
    v = plan_pool_quotas(pool, 40.0, ws, QuotaConfig(), 3.0, trends=burst, device_gb=20.0, cards={"d0": ("d0", 20.0)})
    limits = {c.worker_id: c.patch["memory_limit_gb"] for c in v.changes}
    assert limits == {"w0": 20.0, "w1": 14.0, "w2": 14.0}


def test_a_limit_only_change_has_an_empty_reason() -> None:
    pool = Pool("p", memory_base_gb=8.0, memory_ceiling_gb=16.0)
    ws = [view(0, metrics={"memory_used_gb": 1.0}, memory_quota_gb=8.0)]
    (change,) = plan_pool_quotas(pool, 40.0, ws, QuotaConfig(), 3.0, device_gb=20.0).changes
    assert change.events[0].data["reason"] == ""


def test_gauge_edges_one_sync_and_no_lost_workers() -> None:
    assert sync_success(1.0, 1.0) == 1.0
    g = PoolGauges(0.0, math.nan, math.nan, 0.0, {WorkerState.ACTIVE: 2}, 0)
    assert policy_samples({"q": g})[("dsec_workers_lost", "q", None)] == 0.0


def test_occupancy_counts_every_judged_and_slow_worker_of_a_device() -> None:
    from dsec.decide import occupancy

    occ = occupancy([("d0", "a"), ("d0", "b"), ("d0", "c")], judged={"a", "b"}, slow={"a", "b"})
    assert (occ["d0"].workers, occ["d0"].judged, occ["d0"].slow) == (3, 2, 2)


def test_the_fleet_judgment_uses_the_given_config_and_reports_every_new_outlier() -> None:
    ws = [view(i, metrics={"step_ms_mean": 100.0 + i}) for i in range(3)]
    ws += [view(3, metrics={"step_ms_mean": 900.0}), view(4, metrics={"step_ms_mean": 950.0})]
    ws += [view(5 + i, metrics={"step_ms_mean": 101.0}) for i in range(3)]
    v = judge_pool(POOL, "p", ws, {}, False, FleetConfig(), 1.0)
    assert [(e.worker_id, e.type) for e in v.events] == [
        ("w3", EventType.ANOMALY),
        ("w3", EventType.ALERT),
        ("w4", EventType.ANOMALY),
        ("w4", EventType.ALERT),
    ]
    assert all(e.ts == 1.0 for e in v.events)
    few = [view(i, metrics={"step_ms_mean": 100.0 + i}) for i in range(3)] + [view(3, metrics={"step_ms_mean": 900.0})]
    assert judge_pool(POOL, "p", few, {}, False, FleetConfig(), 1.0).flags["w3"] == {"step_ms_mean"}
    assert judge_pool(POOL, "p", few, {}, False, FleetConfig(min_peers=5), 1.0).flags["w3"] == set()


def test_the_cap_safety_floor_takes_the_fleets_peer_count_and_margin() -> None:
    two = [view(i, metrics={"sync_latency_ms_p50": 60.0}) for i in range(2)]
    assert judge_pool(POOL, "p", two, {}, False, FleetConfig(), 1.0).latency_floor_ms is None  # fewer than 3 peers
    three = [view(i, metrics={"sync_latency_ms_p50": 30.0}) for i in range(3)]
    assert judge_pool(POOL, "p", three, {}, False, FleetConfig(), 1.0, margin=0.2).latency_floor_ms is None
    assert judge_pool(POOL, "p", three, {}, False, FleetConfig(), 1.0, margin=0.5).latency_floor_ms == 45.0


def test_a_pool_of_exactly_the_minimum_peers_can_be_slow_and_counts_only_workers_over_the_cap() -> None:
    cfg = FleetConfig()
    costs = [50.0] + [80.0] * (cfg.min_peers - 1)
    v = judge_pool(POOL, "p", [view(i, metrics={"sync_latency_ms_p50": c}) for i, c in enumerate(costs)], {}, False,
                   cfg, 1.0)  # fmt: skip
    assert v.slow_pool
    (alert,) = [e for e in v.events if e.type is EventType.ALERT]
    n = cfg.min_peers
    assert alert.data["summary"] == f"median sync cost 80.0 ms over the pool's cap 50 ms on {n - 1}/{n} workers"


def test_latency_floors_over_many_pools_are_the_rule_per_pool() -> None:
    # The rule written out plainly (the lower median of the finite costs; floor 1.5 x it when over cap x (1 -
    # margin)), against the array form on random pools with missing, infinite and tied costs: equal exactly.
    rng = np.random.default_rng(5)
    costs = rng.choice([30.0, 40.0, 41.0, 45.0, 60.0, 90.0, np.nan, np.inf, -np.inf], size=(400, 7))
    caps = rng.choice([40.0, 50.0, 85.0], size=400)
    floors = safe_latency_floors(costs, caps, min_peers=3, margin=0.2)
    for row, cap, got in zip(costs.tolist(), caps.tolist(), floors.tolist(), strict=True):
        values = sorted(c for c in row if math.isfinite(c))
        median = values[(len(values) - 1) // 2] if len(values) >= 3 else None
        want = median * 1.5 if median is not None and median > cap * 0.8 else None
        assert (None if math.isnan(got) else got) == want
        assert safe_latency_floor([None if math.isnan(c) else c for c in row], cap, 3, 0.2) == want
    assert np.isnan(floors).sum() not in (0, 400)  # both outcomes occur


def test_a_beats_judgment_reads_the_beats_metrics_never_the_views() -> None:
    """The control plane hands a beat's judgment a kept view whose metrics may be older (control/views.beat_view):
    the same beats judged with views carrying other metrics must decide the same, step by step."""
    events = (anomaly(kind="non_finite_gradient", grad_norm="inf"), anomaly(kind="episode_stuck", count=2))
    stream = [({"sync_latency_ms_p50": 90.0 + k, "grad_norm": 1.0 + (40.0 if k == 9 else 0.0),
                "step_ms_mean": 120.0}, events if k == 12 else ()) for k in range(16)]  # fmt: skip
    runs = []
    for view_metrics in ("beat", {}, {"sync_latency_ms_p50": 1.0, "grad_norm": 1e9, "step_ms_mean": 1e6}):
        breaker, guard, out = Breaker(), PrecisionGuard(min_history=3), []
        for k, (metrics, evs) in enumerate(stream):
            w = view(role="actor", precision="bf16", metrics=metrics if view_metrics == "beat" else view_metrics)
            b = BeatInputs(w, POOL, caps_for(POOL.thresholds, POOL.memory_ceiling_gb, w.fields), metrics, evs, 0,
                           7.0 + k)  # fmt: skip
            v = judge_beat(b, breaker, guard)
            out.append((v.patch, [(e.type, e.data) for e in v.events], breaker.level, breaker.phase))
        runs.append(out)
    assert runs[0] == runs[1] == runs[2]
    assert any(patch for patch, *_ in runs[0])  # the stream decides something (the breaker, the guard)
