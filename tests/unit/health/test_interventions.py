"""The two judgments besides the breaker: stuck episodes (ceiling and priority one step down, an alert)
and the precision guard (fallback on non-finite gradients or norm spikes, revert after a stable period)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.health.interventions import DEFAULT_PRECISION_FALLBACK, PrecisionGuard, agent_name, stuck_episode
from dsec.model import DirectiveFields


# -- agent_name ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("role", "group", "rank", "name"),
    [
        ("actor", "default", 3, "actor3"),
        ("learner", "", 0, "learner0"),
        ("actor", "grp-b", 3, "grp-b.actor3"),
        ("learner", "g:x", 12, "g_x.learner12"),  # ':' is valid in a group name, not in a metric label
        ("other", "a b/c", 1, "a_b_c.other1"),
        ("actor", "g_1.v2", 7, "g_1.v2.actor7"),
    ],
)
def test_agent_name(role: str, group: str, rank: int, name: str) -> None:
    assert agent_name(role, group, rank) == name


# -- stuck_episode -------------------------------------------------------------------------------------
def fields(**kw: Any) -> dict[str, Any]:
    """A directive's fields as the judge passes them (DirectiveFields.to_dict())."""
    return DirectiveFields(**kw).to_dict()


def test_stuck_episode_lowers_the_ceiling_one_step_and_the_priority_one_level() -> None:
    d = stuck_episode(fields(memory_quota_gb=7.0, memory_ceiling_gb=12.0), 7.0, 12.0, "learner0", "collision", 3)
    assert d.patch == {"sync_priority": -1, "memory_ceiling_gb": 11.0}
    assert d.alert == "learner0_episode_stuck_collision_3x"
    assert d.data == {"reason": "collision", "count": 3, "memory_ceiling_gb": [12.0, 11.0], "sync_priority": [0, -1]}
    # The patch is a valid directive change.
    assert DirectiveFields().merged(d.patch).memory_ceiling_gb == 11.0


def test_stuck_episode_repeated_walks_down_to_the_quota_and_stops() -> None:
    f = fields(memory_quota_gb=9.0, memory_ceiling_gb=12.0, sync_priority=2)
    ceilings, priorities = [], []
    for _ in range(15):
        d = stuck_episode(f, 7.0, 12.0, "actor1", "reset", 5)
        f = {**f, **d.patch}
        ceilings.append(f["memory_ceiling_gb"])
        priorities.append(f["sync_priority"])
    assert ceilings[:4] == [11.0, 10.0, 9.0, 9.0]  # never below the worker's quota (9 > base 7)
    assert set(ceilings[3:]) == {9.0}
    assert priorities[:3] == [1, 0, -1]
    assert priorities[-1] == -10 and min(priorities) == -10  # floor


def test_stuck_episode_never_below_the_pool_base() -> None:
    # No quota in the directive: the pool's base is the floor.
    d = stuck_episode(fields(memory_ceiling_gb=7.5), 7.0, 12.0, "actor0", "collision", 3)
    assert d.patch["memory_ceiling_gb"] == 7.0
    d = stuck_episode(fields(memory_quota_gb=2.0, memory_ceiling_gb=7.0), 7.0, 12.0, "actor0", "collision", 3)
    assert "memory_ceiling_gb" not in d.patch  # already at the floor: nothing to lower
    assert d.data["memory_ceiling_gb"] == [7.0, 7.0]
    assert d.patch == {"sync_priority": -1}


def test_stuck_episode_uses_the_pool_ceiling_when_the_directive_has_none() -> None:
    d = stuck_episode(fields(), 4.0, 10.0, "actor0", "collision", 2)
    assert d.patch == {"sync_priority": -1, "memory_ceiling_gb": 9.0}
    d = stuck_episode(fields(), 4.0, 10.0, "actor0", "collision", 2, step_gb=2.5)
    assert d.patch["memory_ceiling_gb"] == 7.5


def test_stuck_episode_never_raises_a_ceiling_that_is_already_below_the_pool_base() -> None:
    # An operator PATCHed this worker to quota 2 / ceiling 5 in a pool whose base is 7 (the directive
    # does not know the pool, so that is valid). "Lower one step" must not turn into a raise to 7.
    d = stuck_episode(fields(memory_quota_gb=2.0, memory_ceiling_gb=5.0), 7.0, 12.0, "actor0", "collision", 3)
    assert d.patch.get("memory_ceiling_gb", 5.0) <= 5.0, d.patch
    assert d.data["memory_ceiling_gb"][1] <= 5.0
    assert d.patch["sync_priority"] == -1


def test_stuck_episode_priority_floor() -> None:
    d = stuck_episode(fields(sync_priority=-10), 7.0, 12.0, "actor0", "collision", 3)
    assert d.patch["sync_priority"] == -10
    assert d.data["sync_priority"] == [-10, -10]
    d = stuck_episode(fields(sync_priority=-9), 7.0, 12.0, "actor0", "collision", 3)
    assert d.patch["sync_priority"] == -10


@pytest.mark.parametrize(
    ("reason", "safe"),
    [
        ("collision", "collision"),
        ("sim crash!", "sim_crash_"),
        ("a-b.c", "a_b_c"),
        ("", "unknown"),
        ("timeout_42", "timeout_42"),
    ],
)
def test_stuck_episode_alert_name_sanitises_the_reason(reason: str, safe: str) -> None:
    d = stuck_episode(fields(), 7.0, 12.0, "grp.actor2", reason, 4)
    assert d.alert == f"grp.actor2_episode_stuck_{safe}_4x"
    assert d.data["reason"] == reason  # the raw reason is kept in the data


# -- PrecisionGuard ------------------------------------------------------------------------------------
def test_defaults() -> None:
    g = PrecisionGuard()
    assert dict(g.mapping) == {"bf16": "fp16", "fp16": "fp32"} == dict(DEFAULT_PRECISION_FALLBACK)
    assert (g.spike_factor, g.min_history, g.stable_s, g.original, g.last_instability) == (10.0, 5, 300.0, None, None)
    # Each guard has its own mapping (a mutation does not leak into the module default).
    g.mapping["fp32"] = "fp32"  # type: ignore[index]
    assert "fp32" not in DEFAULT_PRECISION_FALLBACK


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_gradient_falls_back_along_the_mapping(bad: float) -> None:
    g = PrecisionGuard()
    out = g.observe(bad, "bf16", now=10.0)
    assert out is not None
    patch, data = out
    assert patch == {"precision": "fp16"}
    assert data == {"kind": "non_finite_gradient", "from": "bf16", "to": "fp16", "grad_norm": str(bad)}
    assert (g.original, g.last_instability) == ("bf16", 10.0)
    # No history needed for a non-finite value, and it does not pollute the history.
    assert list(g._norms) == []


def test_custom_mapping() -> None:
    g = PrecisionGuard(mapping={"fp16": "bf16"})
    out = g.instability("non_finite_gradient", "fp16", 1.0, {})
    assert out == ({"precision": "bf16"}, {"kind": "non_finite_gradient", "from": "fp16", "to": "bf16"})
    assert g.instability("non_finite_gradient", "bf16", 2.0, {}) is None


def test_grad_norm_spike_beyond_factor_times_median_after_min_history() -> None:
    g = PrecisionGuard(spike_factor=10.0, min_history=5)
    for i, n in enumerate([1.0, 1.2, 0.9, 1.1, 1.0]):
        assert g.observe(n, "bf16", now=float(i)) is None
    assert g.observe(9.9, "bf16", now=5.0) is None  # 9.9 < 10 x median 1.0
    out = g.observe(12.0, "bf16", now=6.0)
    assert out is not None
    patch, data = out
    assert patch == {"precision": "fp16"}
    assert data["kind"] == "grad_norm_spike" and data["grad_norm"] == 12.0
    assert data["median"] == pytest.approx(1.0, abs=0.2)
    assert (data["from"], data["to"]) == ("bf16", "fp16")
    assert g.last_instability == 6.0 and g.original == "bf16"


def test_no_spike_before_enough_history() -> None:
    g = PrecisionGuard(spike_factor=10.0, min_history=5)
    for i, n in enumerate([1.0, 1.0, 1.0, 1.0]):
        assert g.observe(n, "bf16", now=float(i)) is None
    # Only 4 norms of history: even a 1000x jump is not judged yet.
    assert g.observe(1000.0, "bf16", now=4.0) is None
    assert g.original is None and g.last_instability is None


def test_zero_median_is_not_a_spike() -> None:
    g = PrecisionGuard(min_history=3)
    for i in range(3):
        g.observe(0.0, "bf16", now=float(i))
    assert g.observe(5.0, "bf16", now=3.0) is None


def test_no_fallback_target_returns_none_but_records_the_instability() -> None:
    g = PrecisionGuard()
    assert g.observe(math.nan, "fp32", now=3.0) is None
    assert g.last_instability == 3.0 and g.original is None
    assert g.revert("fp32", now=1e9) is None  # nothing to restore
    # A mapping to itself is no fallback either.
    same = PrecisionGuard(mapping={"fp16": "fp16"})
    assert same.instability("non_finite_gradient", "fp16", 1.0, {}) is None


def test_revert_only_after_stable_s_without_new_instability() -> None:
    g = PrecisionGuard(stable_s=300.0)
    assert g.revert("bf16", now=0.0) is None  # nothing happened yet
    g.instability("non_finite_gradient", "bf16", now=100.0, data={})
    assert g.revert("fp16", now=100.0) is None
    assert g.revert("fp16", now=399.9) is None
    out = g.revert("fp16", now=400.0)
    assert out == (
        {"precision": "bf16"},
        {"kind": "precision_restored", "from": "fp16", "to": "bf16", "stable_s": 300.0},
    )
    assert g.original is None
    assert g.revert("bf16", now=1000.0) is None  # once


def test_new_instability_during_the_stable_period_postpones_the_revert() -> None:
    g = PrecisionGuard(stable_s=300.0)
    g.instability("non_finite_gradient", "bf16", now=100.0, data={})
    # At fp16 it is unstable again at t=350: it falls back further, and the clock restarts.
    out = g.instability("non_finite_gradient", "fp16", now=350.0, data={})
    assert out is not None and out[0] == {"precision": "fp32"}
    assert g.revert("fp32", now=400.0) is None  # 300 s after the first, only 50 s after the second
    assert g.revert("fp32", now=649.9) is None
    out = g.revert("fp32", now=650.0)
    assert out is not None
    assert out[0] == {"precision": "bf16"}  # back to the precision before the *first* fallback
    assert out[1]["from"] == "fp32"


def test_an_instability_without_a_further_target_still_postpones_the_revert() -> None:
    g = PrecisionGuard(stable_s=10.0)
    g.instability("non_finite_gradient", "fp16", now=0.0, data={})  # fp16 -> fp32
    assert g.observe(math.nan, "fp32", now=8.0) is None  # nothing safer than fp32
    assert g.revert("fp32", now=12.0) is None
    assert g.revert("fp32", now=18.0) == (
        {"precision": "fp16"},
        {"kind": "precision_restored", "from": "fp32", "to": "fp16", "stable_s": 10.0},
    )


def test_a_spike_during_the_stable_period_postpones_the_revert() -> None:
    g = PrecisionGuard(stable_s=60.0, min_history=3)
    for i in range(3):
        g.observe(1.0, "bf16", now=float(i))
    assert g.observe(50.0, "bf16", now=10.0) is not None  # bf16 -> fp16
    for t in range(11, 40):
        assert g.observe(1.0, "fp16", now=float(t)) is None
    assert g.observe(200.0, "fp16", now=40.0) is not None  # spike again at fp16 -> fp32
    assert g.revert("fp32", now=71.0) is None  # 61 s after the first, 31 s after the second
    assert g.revert("fp32", now=100.0) is not None


def test_revert_is_a_no_op_when_the_precision_is_already_the_original() -> None:
    g = PrecisionGuard(stable_s=1.0)
    g.instability("non_finite_gradient", "bf16", now=0.0, data={})
    assert g.revert("bf16", now=5.0) is None  # an operator already put it back
    assert g.original is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=0.0, max_value=1e3, allow_nan=False), min_size=1, max_size=100))
def test_the_guard_judges_each_norm_against_the_last_32(norms: list[float]) -> None:
    """Spikes are judged against the median of the 32 norms before (the window a deque(maxlen=32) held), however
    long the run: what the guard answers equals the definition computed from the whole history."""
    g = PrecisionGuard()
    for i, n in enumerate(norms):
        out = g.observe(n, "fp32", now=float(i))  # fp32: no fallback, so only the spike judgement shows
        history = sorted(norms[max(0, i - 32) : i])
        spike = len(history) >= g.min_history and history[len(history) // 2] > 0
        spike = spike and n > g.spike_factor * history[len(history) // 2]
        assert (g.last_instability == float(i)) == spike  # set at this beat exactly when it was a spike
        assert out is None
    assert g._norms == norms[-32:]
