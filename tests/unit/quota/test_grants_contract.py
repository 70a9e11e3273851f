"""How a plan moves grants (quota/grants.py), on the cases mutation testing found unpinned (docs/testing.md): steps
other than 1 GB, the reclaim order and its running account, growth at exactly the fraction, who grows first when
only one step fits, pools of at most 1 GB, and the separator between a worker's reasons."""

from __future__ import annotations

import pytest

from dsec.quota import QuotaConfig, WorkerMemory, plan

STEP2 = QuotaConfig(step_gb=2.0)


def test_growth_leads_a_ramp_on_a_two_gb_grid() -> None:
    # ahead = 3.9 + 1 GB/s * 4 s = 7.9; with slack 8.69; the grid above base 4 in steps of 2 gives 10.
    result = plan(100.0, 4.0, 20.0, [WorkerMemory("a", 3.9, 4.0, ramp_gb_per_s=1.0)], STEP2)
    assert result.changes == {"a": 10.0}


def test_a_reclaim_lands_on_the_two_gb_grid() -> None:
    # a uses 5 (5.5 with slack): on the grid 4, 6, 8 ... it keeps 6 of its 12.
    result = plan(10.0, 4.0, 20.0, [WorkerMemory("a", 5.0, 12.0)], STEP2)
    assert result.changes == {"a": 6.0}


@pytest.mark.parametrize(("over_gb", "expected"), [(2.0, 10.0), (3.0, 8.0)])
def test_a_silent_worker_gives_back_whole_steps(over_gb: float, expected: float) -> None:
    # Over-committed by 2 GB: one 2 GB step from the largest grant; by 3 GB: two steps (what fits is on the grid).
    workers = [WorkerMemory("a", None, 12.0), WorkerMemory("b", None, 10.0)]
    result = plan(22.0 - over_gb, 4.0, 20.0, workers, STEP2)
    assert result.changes == {"a": expected}


def test_reporting_workers_give_back_first_even_after_a_worker_at_base() -> None:
    # The worker at base is passed over; the silent one keeps its grant while the reporting one can give enough.
    workers = [WorkerMemory("base", 1.0, 4.0), WorkerMemory("silent", None, 8.0), WorkerMemory("rep", 2.0, 10.0)]
    result = plan(21.0, 4.0, 12.0, workers)
    assert result.changes == {"rep": 4.0}


def test_the_running_account_lets_every_reporting_worker_give_back_what_is_needed() -> None:
    # Over by 10 GB: a gives 12 -> 4 (8 GB), then b must give too (10 -> 8); the silent c keeps its grant.
    workers = [WorkerMemory("a", 1.0, 12.0), WorkerMemory("b", 7.0, 10.0), WorkerMemory("c", None, 8.0)]
    result = plan(20.0, 4.0, 12.0, workers)
    assert result.changes == {"a": 4.0, "b": 8.0}
    assert result.accounting.granted_gb == 20.0 and result.accounting.headroom_gb == 0.0


def test_the_running_account_goes_on_to_the_next_silent_worker() -> None:
    # Over by 10 GB: a gives 8 (to base), b the 2 still needed.
    workers = [WorkerMemory("a", None, 12.0), WorkerMemory("b", None, 10.0)]
    result = plan(12.0, 4.0, 12.0, workers)
    assert result.changes == {"a": 4.0, "b": 8.0}
    assert "pool over-committed by 10 GB, no usage report" in result.reasons["b"]


def test_a_reporting_worker_that_has_nothing_to_give_is_left_alone() -> None:
    # a's usage plus slack needs its whole grant: no "reclaimed 8 -> 8" line; the silent c gives to base.
    workers = [WorkerMemory("a", 7.5, 8.0), WorkerMemory("c", None, 8.0)]
    result = plan(10.0, 4.0, 12.0, workers)
    assert result.changes == {"c": 4.0}
    assert set(result.reasons) == {"c"}


def test_growth_starts_at_exactly_the_fraction() -> None:
    config = QuotaConfig(grow_when_used_fraction=0.5)
    assert plan(100.0, 4.0, 12.0, [WorkerMemory("a", 5.0, 10.0)], config).changes == {"a": 11.0}
    assert plan(100.0, 4.0, 12.0, [WorkerMemory("a", 4.99, 10.0)], config).changes == {}


def test_when_one_step_fits_the_worker_closest_to_its_quota_grows() -> None:
    # a uses 90 % of 10, b 97.5 % of 4: b is closer, although a uses more.
    workers = [WorkerMemory("a", 9.0, 10.0), WorkerMemory("b", 3.9, 4.0)]
    assert plan(15.0, 4.0, 12.0, workers).changes == {"b": 5.0}


def test_a_grant_under_1_gb_is_ranked_by_its_ratio() -> None:
    # base 0: d holds 0.5 GB and uses 90 % of it, c uses 110 % of 4 GB; one step fits and c is served.
    workers = [WorkerMemory("c", 4.4, 4.0), WorkerMemory("d", 0.45, 0.5)]
    assert plan(5.5, 0.0, 12.0, workers).changes == {"c": 5.0}


def test_pools_of_at_most_1_gb_are_planned() -> None:
    small = QuotaConfig(step_gb=0.25)
    # 1 GB of capacity is known capacity: a worker using all of its 0.5 GB grows by a step.
    assert plan(1.0, 0.0, 1.0, [WorkerMemory("a", 0.5, 0.5)], small).changes == {"a": 0.75}
    # 0.5 GB: no room to grow into.
    assert plan(0.5, 0.0, 1.0, [WorkerMemory("a", 0.5, 0.5)], small).changes == {}
    assert plan(0.5, 0.0, 1.0, [WorkerMemory("a", 0.5, 0.5)], small).accounting.headroom_gb == 0.0


def test_reasons_are_joined_by_a_semicolon() -> None:
    result = plan(100.0, 4.0, 12.0, [WorkerMemory("a", 3.9, 2.0)])
    first, second = result.reasons["a"].split("; ")
    assert first == "raised 2 -> 4 GB: below the pool's base"
    assert second.startswith("grown 4 -> 5 GB: uses 3.9 GB")


def test_a_worker_that_uses_nothing_is_not_grown_even_from_a_zero_grant() -> None:
    assert plan(10.0, 0.0, 12.0, [WorkerMemory("a", 0.0, 0.0)]).changes == {}


@pytest.mark.parametrize("used", [19.9, 20.0])
def test_a_worker_not_ahead_of_its_grant_grows_by_one_step(used: float) -> None:
    # Slack is added only to usage that is ahead of the grant; up to the grant, one step is the growth.
    assert plan(100.0, 4.0, 30.0, [WorkerMemory("a", used, 20.0)]).changes == {"a": 21.0}


def test_idle_reclaim_passes_over_workers_without_a_peak_or_a_report() -> None:
    workers = [
        WorkerMemory("no-peak", 2.0, 8.0),
        WorkerMemory("silent", None, 8.0, recent_peak_gb=2.0),
        WorkerMemory("idle", 2.0, 8.0, recent_peak_gb=2.0),
    ]
    assert plan(100.0, 4.0, 12.0, workers).changes == {"idle": 4.0}


def test_a_worker_reclaimed_as_idle_is_not_grown_in_the_same_plan() -> None:
    # Its ramp would grow it (2 + 1 GB/s * 4 s >= 85 % of 4), but a plan does not take back and grant at once.
    worker = WorkerMemory("a", 2.0, 12.0, ramp_gb_per_s=1.0, recent_peak_gb=2.0)
    assert plan(100.0, 4.0, 12.0, [worker]).changes == {"a": 4.0}
