"""The decision core: pure functions of their inputs (no clock, no I/O), verdicts the control plane and the
simulator both carry out."""

from __future__ import annotations

import copy
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.breaker import Breaker, BreakerConfig
from dsec.decide import (
    BeatInputs,
    PoolGauges,
    WorkerGauges,
    WorkerView,
    caps_for,
    degrade,
    judge_beat,
    judge_pool,
    observe_memory,
    occupancy,
    plan_pool_quotas,
    policy_samples,
    slow_workers,
)
from dsec.health.fleet import FleetConfig
from dsec.health.interventions import PrecisionGuard
from dsec.model import DirectiveFields, Event, EventType, Pool, PoolThresholds, WorkerState
from dsec.quota import MemoryTrend, QuotaConfig
from dsec.quota.trend import BURST_HOLD_S
from dsec.scheduler.device_health import DeviceHealthConfig

POOL = Pool("p", thresholds=PoolThresholds(bandwidth_cap_mbps=100.0, latency_cap_ms=50.0), memory_ceiling_gb=20.0)


def view(i: int = 0, role: str = "actor", metrics: dict[str, float] | None = None, **fields: object) -> WorkerView:
    return WorkerView(f"w{i}", "p", role, "g", i, WorkerState.ACTIVE, DirectiveFields(**fields), metrics or {})  # type: ignore[arg-type]


# -- caps ----------------------------------------------------------------------------------------------------------
def test_caps_take_the_workers_overrides_then_the_pools_then_the_defaults() -> None:
    # As shipped the breaker does not judge memory (memory_pressure None); opted in, at the ceiling times it.
    assert caps_for(POOL.thresholds, 20.0).limits() == {"bandwidth_mbps": 100.0, "latency_ms": 50.0}
    assert caps_for(POOL.thresholds, 20.0, memory_pressure=0.9).limits()["memory_gb"] == 18.0
    own = DirectiveFields(latency_cap_ms=30.0, memory_ceiling_gb=10.0)
    assert caps_for(POOL.thresholds, 20.0, own, memory_pressure=1.0).limits() == {
        "bandwidth_mbps": 100.0,
        "latency_ms": 30.0,
        "memory_gb": 10.0,
    }
    d = PoolThresholds()
    assert caps_for(None, None).limits() == {"bandwidth_mbps": d.bandwidth_cap_mbps, "latency_ms": d.latency_cap_ms}
    assert caps_for(POOL.thresholds, 20.0, None, memory_pressure=0.5).memory_gb == 10.0


# -- per beat ------------------------------------------------------------------------------------------------------
def _beat(w: WorkerView, now: float, events: tuple[Event, ...] = ()) -> BeatInputs:
    return BeatInputs(w, POOL, caps_for(POOL.thresholds, POOL.memory_ceiling_gb, w.fields), w.metrics, events, 0, now)


def test_a_worker_over_its_latency_cap_is_degraded_with_a_meltdown_event_and_alert() -> None:
    breaker, guard = Breaker(BreakerConfig(window_s=10.0, min_samples=3)), PrecisionGuard()
    w = view(metrics={"sync_latency_ms_p50": 200.0})
    verdicts = [judge_beat(_beat(w, 1000.0 + t), breaker, guard) for t in range(3)]
    last = verdicts[-1]
    assert [v.breaker_moved for v in verdicts] == [False, False, True]
    assert last.breaker_issued and last.actors == ["breaker"] and last.patch["compression_bits"] == 4
    kinds = [(e.type, e.data.get("name")) for e in last.events]
    assert kinds == [(EventType.MELTDOWN, None), (EventType.ALERT, f"{w.agent}_meltdown_latency_ms")]
    assert all(e.ts == 1002.0 and e.worker_id == "w0" for e in last.events)  # dated by the caller's now


def test_the_same_inputs_give_the_same_verdict() -> None:
    """Nothing but the arguments decides: two copies of one breaker given one beat agree exactly."""
    b = Breaker(BreakerConfig(window_s=10.0, min_samples=1))
    b2, g, g2 = copy.deepcopy(b), PrecisionGuard(), PrecisionGuard()
    w = view(metrics={"sync_latency_ms_p50": 500.0, "grad_norm": 1.0})
    v1, v2 = judge_beat(_beat(w, 5.0), b, g), judge_beat(_beat(w, 5.0), b2, g2)
    assert (v1.patch, v1.events, v1.actors) == (v2.patch, v2.events, v2.actors) and v1.patch


def test_anomalies_become_alerts_and_patches() -> None:
    w = view(precision="bf16")
    drift = Event(ts=1.0, type=EventType.ANOMALY, data={"kind": "replica_drift", "message": "rank 1 differs"})
    nan = Event(ts=1.0, type=EventType.ANOMALY, data={"kind": "non_finite_gradient", "grad_norm": "nan"})
    stuck = Event(ts=1.0, type=EventType.ANOMALY, data={"kind": "episode_stuck", "reason": "oom", "count": 5})
    v = judge_beat(_beat(w, 2.0, (drift, nan, stuck)), Breaker(), PrecisionGuard())
    names = [e.data["name"] for e in v.events]
    assert names[0] == f"{w.agent}_replica_drift" and v.events[0].data["severity"] == "critical"
    assert any("precision_fallback_bf16_to_fp16" in n for n in names)
    assert v.patch["precision"] == "fp16" and "stuck_episode" in v.actors
    assert all(e.data["source"] == "control_plane" for e in v.events)


# -- fleet ---------------------------------------------------------------------------------------------------------
def test_the_fleet_judgment_flags_a_straggler_and_clears_it_later() -> None:
    ws = [view(i, metrics={"step_ms_mean": 100.0 + i}) for i in range(5)]
    slow = [*ws[:4], view(4, metrics={"step_ms_mean": 900.0})]
    v = judge_pool(POOL, "p", slow, {}, False, FleetConfig(), 10.0)
    assert v.flags["w4"] == {"step_ms_mean"} and v.judged == {f"w{i}" for i in range(5)}
    assert slow_workers(v.flags) == {"w4"}
    assert [(e.type.value, e.data.get("name")) for e in v.events] == [
        ("anomaly", None),
        ("alert", f"{slow[4].agent}_straggler_step_ms_mean"),
    ]
    cleared = judge_pool(POOL, "p", ws, v.flags, False, FleetConfig(), 20.0)
    assert cleared.flags["w4"] == set() and [e.data["kind"] for e in cleared.events] == ["fleet_outlier_cleared"]


def test_a_single_learner_is_not_judged_and_a_whole_slow_pool_alerts_once() -> None:
    ws = [view(i, metrics={"sync_latency_ms_p50": 80.0}) for i in range(3)] + [
        view(9, role="learner", metrics={"sync_latency_ms_p50": 80.0})
    ]
    v = judge_pool(POOL, "p", ws, {}, False, FleetConfig(), 1.0)
    assert "w9" not in v.judged and v.slow_pool
    assert [e.data["name"] for e in v.events] == ["p_pool_sync_slowdown"]
    again = judge_pool(POOL, "p", ws, {}, True, FleetConfig(), 2.0)
    assert again.slow_pool and again.events == []


# -- quotas, devices, gauges ---------------------------------------------------------------------------------------
def test_quota_plans_grow_a_busy_worker_within_the_capacity() -> None:
    pool = Pool("p", memory_base_gb=8.0, memory_ceiling_gb=16.0)
    ws = [view(0, metrics={"memory_used_gb": 7.9}, memory_quota_gb=8.0), view(1, metrics={"memory_used_gb": 1.0})]
    v = plan_pool_quotas(pool, 40.0, ws, QuotaConfig(), 3.0, device_gb=20.0)
    by_id = {c.worker_id: c for c in v.changes}
    change = by_id["w0"]
    assert change.patch["memory_quota_gb"] > 8.0 and change.actor == "quota"
    assert change.events[0].type is EventType.QUOTA and change.events[0].data["from_gb"] == 8.0
    assert v.accounting.capacity_gb == 40.0
    # every reporting worker gets its first allocator limit: what the other does not hold, within one device, and
    # (no burst seen: no trend given) within the pool's ceiling
    assert change.patch["memory_limit_gb"] == 16.0 and change.events[0].data["limit_to_gb"] == 16.0
    assert by_id["w1"].patch == {"memory_limit_gb": 16.0}
    # once issued and unchanged, a limit is not sent again
    issued = [view(0, metrics={"memory_used_gb": 7.9}, memory_quota_gb=10.0, memory_limit_gb=16.0),
              view(1, metrics={"memory_used_gb": 1.0}, memory_limit_gb=16.0)]  # fmt: skip
    assert [c.patch for c in plan_pool_quotas(pool, 40.0, issued, QuotaConfig(), 5.0, device_gb=20.0).changes] == []


def _passes(readings: list[list[float]], memo: object, cards: dict[str, tuple[str, float]]) -> list[object]:
    """Quota passes over 6 workers on 3 cards of 24 GB (2 per card), each pass's changes applied to the next."""
    import dataclasses

    from dsec.decide import observe_memory as observe

    pool = Pool("p", devices=tuple(cards), memory_base_gb=6.0, memory_ceiling_gb=10.0)
    fields = [DirectiveFields.for_pool(pool) for _ in range(6)]
    trends: dict[str, MemoryTrend] = {}
    out: list[object] = []
    for k, used in enumerate(readings):
        ws = [view(i, metrics={"memory_used_gb": used[i]})._replace(fields=fields[i], device=f"d{i}") for i in range(6)]
        trends = observe(trends, ws, 2.0 * k)
        v = plan_pool_quotas(pool, 72.0, ws, QuotaConfig(), 2.0 * k, trends=trends, device_gb=24.0,
                             cards=cards, memo=memo)  # type: ignore[arg-type]  # fmt: skip
        for c in v.changes:
            i = int(c.worker_id[1:])
            fields[i] = dataclasses.replace(fields[i], **c.patch)
        out.append(([(c.worker_id, c.patch, c.events[0].data) for c in v.changes], v.accounting))
    return out


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.lists(st.sampled_from([3.0, 5.5, 6.0, 9.0, 9.5, 14.0, 20.0]), min_size=6, max_size=6),
        min_size=1,
        max_size=12,
    ).map(lambda xs: [x for x in xs for _ in range(2)])  # each reading twice: passes whose inputs repeat
)
def test_a_quota_memo_changes_no_plan_it_only_skips_cards_whose_inputs_repeat(readings: list[list[float]]) -> None:
    cards = {f"d{i}": (f"card{i // 2}", 24.0) for i in range(6)}
    assert _passes(readings, {}, cards) == _passes(readings, None, cards)


def test_a_card_whose_inputs_repeat_after_a_plan_that_changed_nothing_is_not_planned_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dsec.decide.quotas as quotas

    calls: list[tuple[str, ...]] = []
    real = quotas.plan

    def counted(*args: object, **kw: object) -> object:
        calls.append(tuple(m.worker_id for m in args[3]))  # type: ignore[attr-defined]
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(quotas, "plan", counted)
    cards = {f"d{i}": (f"card{i // 2}", 24.0) for i in range(6)}
    memo: dict[object, object] = {}
    _passes([[6.5, 3.0, 3.0, 3.0, 3.0, 3.0]] * 4, memo, cards)
    # Pass 1 plans the 3 cards and grows w0's grant; pass 2 plans card0 again (w0's grant moved) and changes nothing;
    # passes 3 and 4 plan nothing.
    assert calls == [("w0", "w1"), ("w2", "w3"), ("w4", "w5"), ("w0", "w1")]
    assert sorted(memo) == ["card0", "card1", "card2"]  # type: ignore[type-var]
    calls.clear()
    # Another run (fields back at registration's): card0's grant is new again and w5 reads 9 GB; card1 is as before.
    _passes([[6.5, 3.0, 3.0, 3.0, 3.0, 9.0]], memo, cards)
    assert calls == [("w0", "w1"), ("w4", "w5")]


def test_quota_trends_grow_a_ramping_worker_ahead_and_forget_departed_ones() -> None:
    pool = Pool("p", memory_base_gb=8.0, memory_ceiling_gb=16.0)
    trends = observe_memory({}, [view(0, metrics={"memory_used_gb": 5.0})], 0.0)
    ramping = [view(0, metrics={"memory_used_gb": 7.0}, memory_quota_gb=8.0)]
    trends = observe_memory(trends, ramping, 2.0)
    assert trends["w0"].ramp_gb_per_s == pytest.approx(0.5)
    with_ramp = plan_pool_quotas(pool, 40.0, ramping, QuotaConfig(), 2.0, trends=trends)
    without = plan_pool_quotas(pool, 40.0, ramping, QuotaConfig(), 2.0)
    assert with_ramp.changes[0].patch["memory_quota_gb"] > without.changes[0].patch["memory_quota_gb"]
    assert observe_memory(trends, [], 4.0) == {}


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.floats(0.0, 80.0)),  # the earlier reading (None: no trend yet)
            st.one_of(st.none(), st.floats(0.0, 80.0)),  # the new one (None: the beat did not report memory)
            st.floats(0.0, 250.0),  # when the earlier trend was last observed
        ),
        max_size=12,
    )
)
def test_quota_trends_of_a_whole_pool_are_each_workers_own_observe(
    readings: list[tuple[float | None, float | None, float]],
) -> None:
    """observe_memory computes every worker's trend in one numpy call: the same trends, in the same order, as
    MemoryTrend.observe one worker at a time."""
    # a ramp, a peak and a burst to carry on, last observed at different times (some too close to ``now`` for a ramp)
    trends = {
        f"w{i}": MemoryTrend.first(a, 0.0).observe(a * 1.5 + 20.0, at)
        for i, (a, _, at) in enumerate(readings)
        if a is not None
    }
    workers = [view(i, metrics={} if b is None else {"memory_used_gb": b}) for i, (_, b, _) in enumerate(readings)]
    now = 250.2
    expected = {}
    for w in workers:
        used, old = w.metrics.get("memory_used_gb"), trends.get(w.id)
        if used is None:
            if old is not None:
                expected[w.id] = old
        else:
            expected[w.id] = MemoryTrend.first(used, now) if old is None else old.observe(used, now)
    got = observe_memory(trends, workers, now)
    assert list(got) == list(expected)
    assert got == expected


def test_occupancy_counts_only_judged_workers_as_evidence() -> None:
    occ = occupancy([("d0", "a"), ("d0", "b"), ("d1", "c")], judged={"a", "c"}, slow={"a", "b"})
    assert (occ["d0"].workers, occ["d0"].judged, occ["d0"].slow) == (2, 1, 1)
    assert (occ["d1"].workers, occ["d1"].judged, occ["d1"].slow) == (1, 1, 0)
    d = degrade("d0", 100.9, DeviceHealthConfig(recovery_hold_s=60.0))
    assert d.snapshot_request == "degraded-d0-100" and d.hold_until == pytest.approx(160.9)


def test_policy_samples_leave_out_gauges_without_a_value() -> None:
    g = PoolGauges(0.5, math.nan, math.nan, 2.0, {WorkerState.ACTIVE: 3}, 1, {"used": 4.0})
    out = policy_samples({"p": g}, [WorkerGauges("p", "w0", "actor", True, 1.0, 2.0)])
    assert out[("dsec_sandbox_utilization_rate", "p", None)] == 0.5
    assert ("dsec_gradient_sync_success_rate", "p", None) not in out
    assert ("dsec_snapshot_recovery_time", "p", None) not in out
    assert out[("dsec_pool_memory_used_gb", "p", None)] == 4.0
    assert ("dsec_pool_memory_granted_gb", "p", None) not in out
    assert out[("dsec_breaker_level", "p", "w0")] == 2.0


# -- cap safety (issue 17) -----------------------------------------------------------------------------------------
def test_a_cap_the_whole_pool_cannot_get_under_is_lifted_above_the_pools_median() -> None:
    from dsec.decide import safe_latency_floor

    # Every peer at ~53 ms under a 50 ms cap: none could ever be calm (under 40 ms), so the cap in force is 1.5x
    # the median; a worker much slower than its peers (120 ms) is still over it.
    floor = safe_latency_floor([52.0, 53.0, 54.0, 120.0], cap_ms=50.0, min_peers=3, margin=0.2)
    assert floor == pytest.approx(1.5 * 53.0)
    caps = caps_for(POOL.thresholds, None, None, latency_floor_ms=floor)
    assert caps.latency_ms == pytest.approx(79.5) and caps.latency_ms < 120.0
    # One slow worker among healthy peers, or too few peers: the cap stands.
    assert safe_latency_floor([10.0, 11.0, 12.0, 300.0], cap_ms=50.0, min_peers=3) is None
    assert safe_latency_floor([60.0, 60.0], cap_ms=50.0, min_peers=3) is None
    assert caps_for(POOL.thresholds, None, None, latency_floor_ms=None).latency_ms == 50.0


def test_the_fleet_judgment_reports_the_cap_safety_floor() -> None:
    ws = [view(i, metrics={"sync_latency_ms_p50": 48.0 + i}) for i in range(4)]
    v = judge_pool(POOL, "p", ws, {}, False, FleetConfig(), 1.0, margin=0.2)
    assert v.latency_floor_ms == pytest.approx(1.5 * 49.0)
    calm = [view(i, metrics={"sync_latency_ms_p50": 20.0}) for i in range(4)]
    assert judge_pool(POOL, "p", calm, {}, False, FleetConfig(), 1.0).latency_floor_ms is None


# -- room for a burst (dsec.quota.room through plan_pool_quotas) -----------------------------------------------------
def _card_pass(used: list[list[float]], roles: list[str], held: dict[str, float]) -> list[object]:
    """Quota passes 2 s apart over 4 workers on one 24 GB card (``c0``: devices d0-d3), the room hold ``held``
    updated from each pass's requests as the judge does; each pass's room requests."""
    from dsec.decide import observe_memory as observe

    cards = {f"d{i}": ("c0", 24.0) for i in range(4)}
    pool = Pool("p", devices=tuple(cards), memory_base_gb=5.0, memory_ceiling_gb=12.0)
    trends: dict[str, MemoryTrend] = {}
    out: list[object] = []
    for k, row in enumerate(used):
        ws = [view(i, role=roles[i], metrics={"memory_used_gb": row[i]})._replace(device=f"d{i}") for i in range(4)]
        trends = observe(trends, ws, 2.0 * k)
        v = plan_pool_quotas(pool, 24.0, ws, QuotaConfig(), 2.0 * k, trends=trends, device_gb=24.0, cards=cards,
                             room_held=held)  # fmt: skip
        for r in v.rooms:
            held[r.card] = r.until
        out.append(v.rooms)
    return out


def test_a_burst_about_to_fill_a_learners_card_moves_its_largest_actor_once_per_hold() -> None:
    roles = ["learner", "actor", "actor", "actor"]
    # The learner climbs 1 GB/s (a burst) from 6 GB; the actors hold 5, 5.5 and 5 GB: 21.5 GB, then 23.5, 25.5, ...
    used = [[6.0 + 2.0 * k, 5.0, 5.5, 5.0] for k in range(5)]
    held: dict[str, float] = {}
    rooms = _card_pass(used, roles, held)
    firsts = [k for k, r in enumerate(rooms) if r]
    assert firsts == [1], rooms  # at 2 s: 23.5 GB + the ramp over the horizon passes 24; then held, asked once
    (room,) = rooms[1]  # type: ignore[misc]
    assert (room.card, room.worker_id, room.device) == ("c0", "w2", "d2")  # the largest actor
    assert room.until == 2.0 + BURST_HOLD_S and held == {"c0": room.until}
    ev = room.event
    assert ev.type is EventType.ROOM and ev.worker_id == "w2" and ev.data["kind"] == "make_room"
    assert ev.data["bursting"] == ["w0"] and ev.data["device"] == "d2" and ev.data["projected_gb"] > 24.0


def test_no_room_is_made_without_a_learner_on_the_card_or_when_it_is_off() -> None:
    used = [[6.0 + 2.0 * k, 5.0, 5.5, 5.0] for k in range(5)]
    assert not any(_card_pass(used, ["actor"] * 4, {}))  # every worker restarts alone: a move costs as much
    cards = {f"d{i}": ("c0", 24.0) for i in range(4)}
    pool = Pool("p", devices=tuple(cards), memory_base_gb=5.0, memory_ceiling_gb=12.0)
    ws = [view(i, role="learner" if i == 0 else "actor", metrics={"memory_used_gb": 6.0})._replace(device=f"d{i}")
          for i in range(4)]  # fmt: skip
    burst = {"w0": (1.0, 0.0)}  # the learner: ramping at 1 GB/s, a burst seen at t=0; the actors: flat, no burst
    trends = {w.id: MemoryTrend(0.0, 6.0, *burst.get(w.id, (0.0, -math.inf))[:1], 6.0, 0.0,
                                burst.get(w.id, (0.0, -math.inf))[1]) for w in ws}  # fmt: skip
    on = plan_pool_quotas(pool, 24.0, ws, QuotaConfig(), 1.0, trends=trends, cards=cards, room_held={})
    assert [r.worker_id for r in on.rooms] == ["w3"]  # 24 + 1 x 5 > 24: all hold 6 GB, the tie goes to the last id
    off = plan_pool_quotas(pool, 24.0, ws, QuotaConfig(), 1.0, trends=trends, cards=cards)
    assert off.rooms == []  # room_held None: the judge's make_room is off
