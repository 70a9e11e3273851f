"""Elastic memory quotas: base guarantee, growth under headroom, reclaim under over-commit."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.quota import PoolMemory, QuotaConfig, QuotaPlan, WorkerMemory, plan

BASE, CEILING = 7.0, 12.0


def w(worker_id: str, used: float | None, quota: float = BASE) -> WorkerMemory:
    return WorkerMemory(worker_id, used, quota)


def test_quotas_below_base_are_raised_and_above_ceiling_lowered() -> None:
    result = plan(100.0, BASE, CEILING, [w("a", 1.0, 2.0), w("b", 1.0, 20.0), w("c", 1.0, 8.0)])
    assert result.changes == {"a": BASE, "b": CEILING}
    assert "below the pool's base" in result.reasons["a"]
    assert "above the pool's ceiling" in result.reasons["b"]
    assert "c" not in result.reasons


def test_base_is_guaranteed_even_when_the_pool_cannot_hold_it() -> None:
    result = plan(10.0, BASE, CEILING, [w("a", 6.9, 5.0), w("b", 6.9, 5.0)])
    assert result.changes == {"a": BASE, "b": BASE}
    assert result.accounting.granted_gb == 14.0
    assert result.accounting.headroom_gb == -4.0


def test_a_busy_worker_grows_one_step_while_there_is_headroom() -> None:
    result = plan(40.0, BASE, CEILING, [w("a", 6.5), w("b", 3.0)])  # 6.5 >= 0.85 * 7
    assert result.changes == {"a": 8.0}
    assert "grown 7 -> 8 GB" in result.reasons["a"]
    assert result.accounting == PoolMemory(
        capacity_gb=40.0, granted_gb=15.0, used_gb=9.5, headroom_gb=25.0, base_gb=BASE, ceiling_gb=CEILING, workers=2
    )


def test_growth_stops_at_the_ceiling() -> None:
    config = QuotaConfig(step_gb=2.0)
    result = plan(100.0, BASE, CEILING, [w("a", 11.5, 11.0), w("b", 12.0, 12.0)], config)
    assert result.changes == {"a": CEILING}  # 11 + 2 capped at 12; b already at the ceiling
    assert plan(100.0, BASE, CEILING, [w("a", 11.5, 12.0)], config).changes == {}


def test_under_scarcity_the_workers_closest_to_their_quota_grow_first() -> None:
    workers = [w("a", 6.0), w("b", 6.9), w("c", 6.5), w("d", 6.9)]  # all >= 85% of 7
    result = plan(30.0, BASE, CEILING, workers)  # 28 granted: room for two steps
    assert result.changes == {"b": 8.0, "d": 8.0}  # highest ratio; b before d by id on the tie
    result = plan(29.0, BASE, CEILING, workers)
    assert result.changes == {"b": 8.0}


def test_reserve_is_never_granted() -> None:
    result = plan(16.0, BASE, CEILING, [w("a", 6.9), w("b", 6.9)], QuotaConfig(reserve_gb=2.0))
    assert result.changes == {}
    assert result.accounting.headroom_gb == 0.0


def test_over_committed_pool_reclaims_largest_unused_grant_first_never_below_base() -> None:
    workers = [w("a", 7.5, 12.0), w("b", 2.0, 12.0), w("c", 11.0, 12.0)]
    result = plan(31.0, BASE, CEILING, workers)  # 36 granted, 5 too many
    # b has the largest unused grant: back to base (2 * 1.1 < 7), which is enough.
    assert result.changes == {"b": BASE}
    assert "over-committed by 5 GB" in result.reasons["b"]
    result = plan(20.0, BASE, CEILING, workers)  # needs 16 back: a goes to ceil(7.5 * 1.1) = 9 too
    assert result.changes == {"b": BASE, "a": 9.0}
    assert result.accounting.granted_gb == 28.0  # c uses 11 (x1.1 > 12): nothing left to take


def test_a_worker_without_usage_report_gives_back_only_what_is_needed_to_fit() -> None:
    workers = [w("a", None, 12.0), w("b", 6.8, 8.0), w("c", None, 10.0)]
    result = plan(30.0, BASE, CEILING, workers)  # 30 granted: fits; b (6.8 >= 85% of 8) has no room to grow
    assert "a" not in result.changes and "c" not in result.changes
    result = plan(27.0, BASE, CEILING, workers)  # 3 too many; b cannot give (6.8 * 1.1 -> 8)
    assert result.changes == {"a": 9.0}
    assert "no usage report" in result.reasons["a"]


def test_a_worker_without_usage_report_does_not_grow() -> None:
    assert plan(100.0, BASE, CEILING, [w("a", None)]).changes == {}


def test_over_ceiling_is_reported_not_killed() -> None:
    result = plan(100.0, BASE, CEILING, [w("a", 13.5, 12.0), w("b", 5.0)])
    assert result.over_ceiling == ("a",)
    assert result.changes == {}
    assert "over ceiling" in result.reasons["a"]


@pytest.mark.parametrize("capacity", [None, 0.0])
def test_unknown_capacity_only_clamps(capacity: float | None) -> None:
    workers = [w("a", 6.9), w("b", 6.9, 3.0), w("c", 1.0, 12.0)]
    result = plan(capacity, BASE, CEILING, workers)
    assert result.changes == {"b": BASE}
    assert result.accounting.headroom_gb is None
    assert result.accounting.capacity_gb == capacity


def test_plans_are_deterministic_whatever_the_input_order() -> None:
    workers = [w(f"w{i}", 6.0 + (i % 3) * 0.5, 7.0) for i in range(9)]
    first = plan(70.0, BASE, CEILING, workers)
    assert plan(70.0, BASE, CEILING, list(reversed(workers))) == first
    assert first.to_dict()["accounting"]["workers"] == 9


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: plan(-1.0, BASE, CEILING, []), "capacity_gb"),
        (lambda: plan(math.inf, BASE, CEILING, []), "capacity_gb"),
        (lambda: plan(10.0, math.nan, CEILING, []), "base_gb"),
        (lambda: plan(10.0, BASE, 5.0, []), "ceiling_gb"),
        (lambda: plan(10.0, BASE, CEILING, [w("a", 1.0), w("a", 2.0)]), "worker_id"),
        (lambda: WorkerMemory("a", -1.0, 7.0), "used_gb"),
        (lambda: WorkerMemory("a", 1.0, math.inf), "quota_gb"),
        (lambda: WorkerMemory("", 1.0, 7.0), "worker_id"),
        (lambda: QuotaConfig(step_gb=0), "step_gb"),
        (lambda: QuotaConfig(grow_when_used_fraction=1.5), "grow_when_used_fraction"),
        (lambda: QuotaConfig(slack_fraction=-0.1), "slack_fraction"),
        (lambda: QuotaConfig(reserve_gb=math.nan), "reserve_gb"),
    ],
)
def test_invalid_inputs_name_the_field(call: object, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        call()  # type: ignore[operator]


# -- properties -------------------------------------------------------------------------------------
@st.composite
def pools(draw: st.DrawFn) -> tuple[float | None, float, float, list[WorkerMemory], QuotaConfig]:
    base = draw(st.sampled_from([0.0, 1.0, 4.0, 7.0]))
    ceiling = base + draw(st.sampled_from([0.0, 0.5, 3.0, 5.0, 8.0]))
    config = QuotaConfig(
        step_gb=draw(st.sampled_from([0.25, 0.5, 1.0, 2.0])),
        grow_when_used_fraction=draw(st.sampled_from([0.5, 0.85, 1.0])),
        slack_fraction=draw(st.sampled_from([0.0, 0.1, 0.5])),
        reserve_gb=draw(st.sampled_from([0.0, 2.0])),
    )
    n = draw(st.integers(0, 8))
    workers = [
        WorkerMemory(
            f"w{i}",
            draw(st.one_of(st.none(), st.floats(0, ceiling * 1.5 + 1))),
            draw(st.floats(0, ceiling * 1.5 + 1)),
        )
        for i in range(n)
    ]
    capacity = draw(st.one_of(st.none(), st.floats(0, 120)))
    return capacity, base, ceiling, workers, config


def clamped(q: float, base: float, ceiling: float) -> float:
    return min(ceiling, max(base, q))


def granted(workers: list[WorkerMemory] | tuple[WorkerMemory, ...]) -> float:
    return math.fsum(x.quota_gb for x in workers)


TOL = 1e-6


@settings(max_examples=400, deadline=None)
@given(pools())
def test_after_the_plan_every_quota_is_within_base_and_ceiling(
    pool: tuple[float | None, float, float, list[WorkerMemory], QuotaConfig],
) -> None:
    capacity, base, ceiling, workers, config = pool
    result = plan(capacity, base, ceiling, workers, config)
    for x in result.apply(workers):
        assert base <= x.quota_gb <= ceiling
    assert all(result.changes[k] != x.quota_gb for x in workers for k in result.changes if k == x.worker_id)
    assert math.isclose(result.accounting.granted_gb, granted(result.apply(workers)))


@settings(max_examples=400, deadline=None)
@given(pools())
def test_growth_never_over_commits_and_a_fitting_pool_keeps_fitting(
    pool: tuple[float | None, float, float, list[WorkerMemory], QuotaConfig],
) -> None:
    capacity, base, ceiling, workers, config = pool
    result = plan(capacity, base, ceiling, workers, config)
    before = math.fsum(clamped(x.quota_gb, base, ceiling) for x in workers)
    after = granted(result.apply(workers))
    if capacity is None or capacity == 0:
        assert after == pytest.approx(before)  # no device information: clamping only
        return
    usable = max(0.0, capacity - config.reserve_gb)
    assert after <= max(before, usable) + TOL
    if before <= usable:
        assert after <= usable + TOL


@settings(max_examples=300, deadline=None)
@given(pools())
def test_repeated_plans_with_constant_usage_reach_a_fixed_point(
    pool: tuple[float | None, float, float, list[WorkerMemory], QuotaConfig],
) -> None:
    capacity, base, ceiling, workers, config = pool
    # One round to clamp/reclaim, one growth round per step between base and ceiling, one to confirm.
    rounds = math.ceil((ceiling - base) / config.step_gb) + 2
    current: tuple[WorkerMemory, ...] = tuple(workers)
    for _ in range(rounds):
        result: QuotaPlan = plan(capacity, base, ceiling, current, config)
        if not result.changes:
            break
        current = result.apply(current)
    assert plan(capacity, base, ceiling, current, config).changes == {}


def test_growth_stops_at_a_workers_own_lower_ceiling_and_leaves_headroom_to_peers() -> None:
    # A's ceiling was lowered to 3 (stuck episodes); B may still grow into the last free GB.
    workers = [
        WorkerMemory("a", used_gb=2.9, quota_gb=3.0, ceiling_gb=3.0),
        WorkerMemory("b", used_gb=1.9, quota_gb=2.0),
    ]
    p = plan(6.0, 2.0, 4.0, workers)
    assert p.changes == {"b": 3.0}
