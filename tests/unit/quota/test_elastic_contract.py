"""Elastic quotas: the plan as the control plane records it, and the input checks with the messages that name the field
and the worker (written against the survivors of `make mutation`, docs/testing.md)."""

from __future__ import annotations

import math

import pytest

from dsec.quota import QuotaConfig, WorkerMemory, plan


def test_a_plan_serialises_every_field() -> None:
    result = plan(40.0, 4.0, 12.0, [WorkerMemory("a", 6.5, 7.0), WorkerMemory("b", None, 2.0)])
    assert result.to_dict() == {
        "changes": {"a": 8.0, "b": 4.0},
        "over_ceiling": [],
        "accounting": {"capacity_gb": 40.0, "granted_gb": 12.0, "used_gb": 6.5, "headroom_gb": 28.0,
                       "base_gb": 4.0, "ceiling_gb": 12.0, "workers": 2},
        "reasons": result.reasons,
        # a reports usage and is not in a burst: its limit stops at the ceiling (b reports nothing: no limit)
        "limit_changes": {"a": 12.0},
    }  # fmt: skip
    assert set(result.reasons) == {"a", "b"}


@pytest.mark.parametrize("field", ["used_gb", "quota_gb", "ceiling_gb"])
@pytest.mark.parametrize("bad", [-0.5, math.inf, math.nan, True, "1"])
def test_worker_memory_rejects_what_is_not_a_finite_nonnegative_number(field: str, bad: object) -> None:
    kwargs: dict[str, object] = {"used_gb": 1.0, "quota_gb": 2.0, "ceiling_gb": 3.0, field: bad}
    with pytest.raises(ValueError) as err:
        WorkerMemory("w-1", **kwargs)  # type: ignore[arg-type]
    assert str(err.value) == f"{field}={bad!r} for worker 'w-1' is invalid: expected a finite number >= 0"


def test_worker_memory_accepts_zero_and_no_report() -> None:
    w = WorkerMemory("w-1", used_gb=0.0, quota_gb=0.0, ceiling_gb=0.0)
    assert (w.used_gb, w.quota_gb, w.ceiling_gb) == (0.0, 0.0, 0.0)
    assert WorkerMemory("w-1", used_gb=None, quota_gb=1.0).ceiling_gb is None
    with pytest.raises(ValueError, match=r"^worker_id=''"):
        WorkerMemory("", used_gb=None, quota_gb=1.0)


def test_quota_config_names_the_field() -> None:
    assert QuotaConfig(reserve_gb=0.0, slack_fraction=0.0, grow_when_used_fraction=1.0).reserve_gb == 0.0
    bad_values = (("step_gb", 0.0), ("step_gb", "1"), ("reserve_gb", -1.0), ("slack_fraction", -0.1),
                  ("grow_when_used_fraction", 0.0))  # fmt: skip
    for field, bad in bad_values:
        with pytest.raises(ValueError, match=f"^{field}="):
            QuotaConfig(**{field: bad})


def test_plan_checks_name_the_argument() -> None:
    for args, name in (((-1.0, 4.0, 12.0), "capacity_gb"), ((40.0, -1.0, 12.0), "base_gb"), ((40.0, 4.0, -1.0),
                       "ceiling_gb")):  # fmt: skip
        with pytest.raises(ValueError, match=f"^{name}=-1.0 is invalid"):
            plan(*args, [])


def test_quotas_at_base_or_ceiling_and_usage_at_the_ceiling_are_in_bounds() -> None:
    result = plan(100.0, 4.0, 12.0, [WorkerMemory("a", 1.0, 4.0), WorkerMemory("b", 12.0, 12.0)])
    assert result.changes == {} and result.reasons == {} and result.over_ceiling == ()
    over = plan(100.0, 4.0, 12.0, [WorkerMemory("b", 12.5, 12.0)])
    assert over.over_ceiling == ("b",)


def test_apply_keeps_the_reported_usage() -> None:
    workers = [WorkerMemory("a", 6.5, 7.0)]
    result = plan(40.0, 4.0, 12.0, workers)
    assert result.apply(workers) == (WorkerMemory("a", 6.5, 8.0, limit_gb=12.0),)


def test_a_worker_with_two_changes_gets_both_reasons() -> None:
    # Raised to the base, and then grown (its usage is near the new quota): one reason line per change.
    result = plan(100.0, 4.0, 12.0, [WorkerMemory("a", 3.9, 2.0)])
    assert result.changes == {"a": 5.0}
    assert "; " in result.reasons["a"] and len(result.reasons["a"].split("; ")) == 2


# -- written against the survivors of the 2026-12-02 evening run (docs/testing.md) ------------------------------------


@pytest.mark.parametrize("field", ["ramp_gb_per_s", "recent_peak_gb", "limit_gb"])
def test_worker_memory_names_each_optional_field_it_rejects(field: str) -> None:
    with pytest.raises(ValueError) as err:
        WorkerMemory("w-1", used_gb=1.0, quota_gb=2.0, **{field: -1.0})  # type: ignore[arg-type]
    assert str(err.value) == f"{field}=-1.0 for worker 'w-1' is invalid: expected a finite number >= 0"


@pytest.mark.parametrize("field", ["quota_gb", "ramp_gb_per_s"])
def test_worker_memory_fails_none_for_the_two_fields_that_need_a_value(field: str) -> None:
    kwargs: dict[str, object] = {"used_gb": 1.0, "quota_gb": 2.0, field: None}
    with pytest.raises(ValueError) as err:
        WorkerMemory("w-1", **kwargs)  # type: ignore[arg-type]
    assert str(err.value).startswith(f"{field}=None for worker 'w-1' is invalid")


def test_integer_zero_and_fractions_are_valid_amounts() -> None:
    # ints (and a config's integers) go through the full check, not the float fast path: 0 and 0.5-like values pass
    w = WorkerMemory("w-1", used_gb=0, quota_gb=0, ceiling_gb=0, limit_gb=0)  # type: ignore[arg-type]
    assert (w.used_gb, w.quota_gb, w.limit_gb) == (0, 0, 0)
    assert QuotaConfig(reserve_gb=0, ramp_horizon_s=0).ramp_horizon_s == 0  # type: ignore[arg-type]
    import numpy as np

    assert WorkerMemory("w-2", used_gb=np.float64(0.5), quota_gb=1.0).used_gb == 0.5  # not a float subclass check


def test_quota_config_names_a_bad_ramp_horizon() -> None:
    with pytest.raises(ValueError) as err:
        QuotaConfig(ramp_horizon_s=-1.0)
    assert str(err.value) == "ramp_horizon_s=-1.0 is invalid: expected a finite number >= 0"


def test_applying_a_plan_keeps_the_limits_it_does_not_change() -> None:
    workers = [WorkerMemory("a", None, 4.0, limit_gb=6.0), WorkerMemory("b", 1.0, 4.0, limit_gb=4.0)]
    result = plan(None, 1.0, 8.0, workers)  # no capacity: no limit is planned
    assert result.limit_changes == {}
    assert [w.limit_gb for w in result.apply(workers)] == [6.0, 4.0]


def test_a_worker_without_a_report_does_not_end_the_limit_pass() -> None:
    # the unreported worker comes first: the ones after it still get their limits
    workers = [WorkerMemory("quiet", None, 4.0), WorkerMemory("a", 1.0, 4.0), WorkerMemory("b", 1.0, 4.0)]
    result = plan(32.0, 4.0, 8.0, workers)
    assert set(result.limit_changes) == {"a", "b"}


def test_a_limit_at_its_quota_moves_only_by_a_whole_step() -> None:
    # the limit is the quota (4 GB); the new one (the 4.5 GB ceiling: the worker is not in a burst) is half a step
    # away, so it stays — the hysteresis applies from the quota up as well
    w = WorkerMemory("a", 1.0, 4.0, limit_gb=4.0)
    result = plan(32.0, 4.0, 4.5, [w])
    assert result.changes == {}
    assert result.limit_changes == {}
    # one below its quota is raised at once (a limit under the grant would fail allocations the grant allows)
    below = plan(32.0, 4.0, 4.5, [WorkerMemory("a", 1.0, 4.0, limit_gb=3.9)])
    assert below.limit_changes == {"a": 4.5}
