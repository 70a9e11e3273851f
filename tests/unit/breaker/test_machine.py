"""The breaker's state machine, driven beat by beat in virtual time with a worker that acks directives."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsec.breaker import (
    MAX_LEVEL,
    TRANSITIONS,
    Action,
    Breaker,
    BreakerConfig,
    Caps,
    Phase,
    Sample,
    Transition,
    Trigger,
    fields_for,
    level_of,
)

CAPS = Caps(bandwidth_mbps=128.0, latency_ms=85.0)
CONFIG = BreakerConfig(window_s=3.0, min_samples=3, overload_fraction=0.75, margin=0.2, recovery_s=5.0)
DT = 0.5


@dataclass
class Run:
    breaker: Breaker
    transitions: list[tuple[float, Transition]] = field(default_factory=list)
    levels: list[int] = field(default_factory=list)
    version: int = 1
    acked: int = 1


def drive(
    latency: Callable[[int], float | None],
    beats: int,
    ack_after_beats: int = 1,
    config: BreakerConfig = CONFIG,
    bandwidth: Callable[[int], float | None] = lambda i: None,
) -> Run:
    """Feed one sample per beat; the worker acks each directive ``ack_after_beats`` beats after it was issued."""
    run = Run(Breaker(config))
    due: int | None = None
    for i in range(beats):
        now = i * DT
        if due is not None and i >= due:
            run.acked, due = run.version, None
        run.breaker.observe(Sample(now, latency_ms=latency(i), bandwidth_mbps=bandwidth(i)), CAPS)
        t = run.breaker.decide(now, CAPS, run.acked)
        if t is not None:
            run.transitions.append((now, t))
            if t.action in (Action.ESCALATE, Action.STEP_DOWN):
                run.version += 1
                run.breaker.issued(run.version, now)
                due = i + ack_after_beats
        run.levels.append(run.breaker.level)
    return run


def test_sustained_overload_escalates_one_level_per_ack_to_the_top_and_holds() -> None:
    run = drive(lambda i: 200.0, beats=200)
    actions = [t.action for _, t in run.transitions]
    assert actions.count(Action.ESCALATE) == MAX_LEVEL
    assert Action.STEP_DOWN not in actions
    assert run.breaker.level == MAX_LEVEL and run.breaker.phase is Phase.OPEN
    assert run.breaker.meltdowns == 1
    first = run.transitions[0][1]
    assert first.meltdown and first.evidence["over"]["latency_ms"]["cap"] == 85.0
    # Each escalation after the first needs min_samples fresh samples after the ack beat.
    escalate_times = [ts for ts, t in run.transitions if t.action is Action.ESCALATE]
    assert escalate_times[0] == pytest.approx((CONFIG.min_samples - 1) * DT)
    for a, b in itertools.pairwise(escalate_times):
        assert b - a >= (1 + CONFIG.min_samples) * DT - 1e-9


def test_one_slow_sample_is_not_evidence() -> None:
    run = drive(lambda i: 500.0 if i == 10 else 20.0, beats=100)
    assert run.transitions == []


def test_constant_signal_at_the_cap_never_moves_the_breaker() -> None:
    assert drive(lambda i: 85.0, beats=300).transitions == []


def test_samples_at_the_cap_do_not_count_as_exceeding_it() -> None:
    # Only the newest sample is strictly over: one of four exceeds the cap, below overload_fraction.
    # With ">=" the three samples sitting exactly at 85 would count and the worker would escalate.
    run = drive(lambda i: [85.0, 85.0, 85.0, 90.0][i], beats=4)
    assert run.transitions == []
    assert run.breaker.level == 0


def test_exactly_overload_fraction_of_the_window_escalates() -> None:
    # Three of four strictly over (0.75 * 4 == 3): the fraction is a ">=" boundary, inclusive.
    run = drive(lambda i: [20.0, 90.0, 90.0, 90.0][i], beats=4)
    assert [t.action for _, t in run.transitions] == [Action.ESCALATE]
    assert run.transitions[0][1].evidence["over"]["latency_ms"]["exceeding"] == 3


def test_recovery_steps_down_one_level_at_a_time_and_closes() -> None:
    run = drive(lambda i: 200.0 if i < 40 else 10.0, beats=400)
    assert run.breaker.level == 0 and run.breaker.phase is Phase.CLOSED
    downs = [t for _, t in run.transitions if t.action is Action.STEP_DOWN]
    assert [t.level_after for t in downs] == [2, 1, 0]
    assert run.transitions[-1][1].after is Phase.CLOSED
    assert run.breaker.wait_s == CONFIG.recovery_s


def test_relapse_while_half_open_doubles_the_wait_bounded() -> None:
    cfg = BreakerConfig(window_s=3.0, min_samples=3, margin=0.2, recovery_s=5.0, max_recovery_s=12.0)
    # Calm long enough to step down, then overloaded again, three times.
    pattern = [200.0] * 20 + [10.0] * 16 + [200.0] * 10 + [10.0] * 16 + [200.0] * 10 + [10.0] * 30 + [200.0] * 10
    run = drive(lambda i: pattern[i], beats=len(pattern), config=cfg)
    relapses = [t for _, t in run.transitions if t.relapse]
    assert len(relapses) >= 2
    assert run.breaker.wait_s == 12.0  # 5 -> 10 -> 12 (bounded)


def test_bandwidth_cap_is_the_second_threshold() -> None:
    run = drive(lambda i: 10.0, beats=20, bandwidth=lambda i: 300.0)
    first = run.transitions[0][1]
    assert first.action is Action.ESCALATE and set(first.evidence["over"]) == {"bandwidth_mbps"}


def test_no_escalation_while_a_directive_waits_for_its_ack() -> None:
    run = drive(lambda i: 200.0, beats=100, ack_after_beats=10**6)
    assert [t.action for _, t in run.transitions] == [Action.ESCALATE]
    assert run.breaker.phase is Phase.ESCALATING


def test_missing_signal_is_not_overload() -> None:
    assert drive(lambda i: None, beats=50).transitions == []


def test_resumed_breaker_needs_calm_before_stepping_down() -> None:
    b = Breaker.resumed(CONFIG, level=2, now=100.0)
    assert b.phase is Phase.OPEN
    b.observe(Sample(99.0, latency_ms=10.0), CAPS)  # older than the resume: ignored
    assert b.decide(100.0, CAPS, acked_version=1) is None


def test_transition_table_never_skips_an_ack() -> None:
    # Every ESCALATE/STEP_DOWN leads to a phase whose only way out is ACKED.
    for (_, _, _), (after, action) in TRANSITIONS.items():
        if action is not Action.NONE:
            outs = {trig for (phase, trig, _) in TRANSITIONS if phase is after}
            assert outs == {Trigger.ACKED}


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="margin"):
        BreakerConfig(margin=1.5)
    with pytest.raises(ValueError, match="max_recovery_s"):
        BreakerConfig(recovery_s=10, max_recovery_s=5)


def test_ladder_round_trips_levels() -> None:
    for level in range(MAX_LEVEL + 1):
        assert level_of(fields_for(level)) == level
    mem = fields_for(1, causes=("memory_gb",), memory_ceiling_gb=12.0)
    assert mem["grad_accum_steps"] == 4 and mem["memory_quota_gb"] == 12.0
    with pytest.raises(ValueError, match="level"):
        fields_for(4)


# -- properties ------------------------------------------------------------------------------------------

signals = st.lists(st.one_of(st.none(), st.floats(0, 400)), min_size=1, max_size=300)


@settings(max_examples=200, deadline=None)
@given(signals, st.integers(1, 5))
def test_at_most_one_level_per_acked_directive(values: list[float | None], ack_after: int) -> None:
    run = drive(lambda i: values[i], beats=len(values), ack_after_beats=ack_after)
    kinds = [t.trigger for _, t in run.transitions]
    for a, b in itertools.pairwise(kinds):
        if a is not Trigger.ACKED:
            assert b is Trigger.ACKED  # a directive-issuing transition is followed by its ack
    for prev, cur in zip([0, *run.levels], run.levels, strict=False):
        assert abs(cur - prev) <= 1 and 0 <= cur <= MAX_LEVEL


@settings(max_examples=100, deadline=None)
@given(st.floats(85.0 * (1 - CONFIG.margin), 85.0), st.integers(50, 400))
def test_no_oscillation_for_constant_signal_in_the_hysteresis_band(value: float, beats: int) -> None:
    assert drive(lambda i: value, beats=beats).transitions == []


@settings(max_examples=100, deadline=None)
@given(st.floats(85.01, 1e4), st.integers(1, 4))
def test_monotone_escalation_under_sustained_overload(value: float, ack_after: int) -> None:
    run = drive(lambda i: value, beats=300, ack_after_beats=ack_after)
    assert run.levels == sorted(run.levels)
    assert run.breaker.level == MAX_LEVEL


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 400), min_size=1, max_size=120), st.floats(0, 67.0), st.integers(1, 4))
def test_full_recovery_after_the_fault_ends(fault: list[float], calm: float, ack_after: int) -> None:
    # Whatever happened during the fault, a calm signal afterwards brings the worker back to level 0.
    cfg = BreakerConfig(window_s=3.0, min_samples=3, margin=0.2, recovery_s=5.0, max_recovery_s=40.0)
    n = len(fault)
    run = drive(lambda i: fault[i] if i < n else calm, beats=n + 600, ack_after_beats=ack_after, config=cfg)
    assert run.breaker.level == 0 and run.breaker.phase is Phase.CLOSED
