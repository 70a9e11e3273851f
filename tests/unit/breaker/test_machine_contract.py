"""What the breaker records and where its boundaries lie, sample by sample at chosen times: the evidence of each
transition as the control plane stores it, the counters, the hysteresis line, the evidence window's edges, the
undo state and the configuration's limits (written against the survivors of `make mutation`, docs/testing.md)."""

from __future__ import annotations

import pytest

from dsec.breaker import Action, Breaker, BreakerConfig, Caps, Phase, Sample, Transition

CAPS = Caps(bandwidth_mbps=128.0, latency_ms=85.0)
CONFIG = BreakerConfig(window_s=3.0, min_samples=3, overload_fraction=0.75, margin=0.2, recovery_s=2.0,
                       max_recovery_s=20.0)  # fmt: skip
CAP_LIMITS = {"bandwidth_mbps": 128.0, "latency_ms": 85.0}


def feed(b: Breaker, points: list[tuple[float, float]], acked: int = 0) -> list[Transition]:
    """Observe each (ts, latency) and decide at its ts; answers the transitions."""
    out = []
    for ts, latency in points:
        b.observe(Sample(ts, latency_ms=latency), CAPS)
        t = b.decide(ts, CAPS, acked)
        if t is not None:
            out.append(t)
    return out


def test_each_transition_records_its_evidence_exactly() -> None:
    b = Breaker(CONFIG)
    assert b.wait_s == CONFIG.recovery_s
    [melt] = feed(b, [(0.0, 20.0), (0.5, 300.0), (1.0, 200.0), (1.5, 100.0)])
    assert melt.to_dict() == {
        "from": "closed", "to": "escalating", "trigger": "overload", "action": "escalate", "level_from": 0,
        "level_to": 1, "meltdown": True, "relapse": False,
        "evidence": {
            "over": {"latency_ms": {"cap": 85.0, "median": 200.0, "max": 300.0, "exceeding": 3, "samples": 4}},
            "window_s": 3.0, "evidence_since": None,
        },
    }  # fmt: skip
    assert b.causes == ("latency_ms",) and b.meltdowns == 1
    b.issued(2, now=1.5)
    [ack] = feed(b, [(2.0, 100.0)], acked=2)
    assert (ack.trigger.value, ack.evidence, ack.meltdown, ack.relapse) == ("acked", {"acked_version": 2}, False, False)
    # The ack beat's own sample (and anything before it) is not evidence for the next level.
    [again] = feed(b, [(2.5, 100.0), (3.0, 100.0), (3.5, 100.0)], acked=2)
    assert again.evidence["evidence_since"] == 2.0 and again.level_before == 1 and not again.meltdown
    b.issued(3, now=3.5)
    feed(b, [(4.0, 10.0)], acked=3)  # acked: OPEN at level 2
    calm = feed(b, [(4.1234, 10.0), (5.0, 10.0), (6.24685, 10.0)], acked=3)
    assert [t.to_dict() for t in calm] == [
        {
            "from": "open", "to": "recovering", "trigger": "calm", "action": "step_down", "level_from": 2,
            "level_to": 1, "meltdown": False, "relapse": False,
            "evidence": {"calm_for_s": 2.123, "wait_s": 2.0, "samples": 3, "margin": 0.2, "caps": CAP_LIMITS},
        }
    ]  # fmt: skip
    assert b.to_dict() == {"phase": "recovering", "level": 1, "wait_s": 2.0, "awaiting_version": None, "meltdowns": 1,
                           "relapses": 0, "causes": ["latency_ms"]}  # fmt: skip


def test_counters_and_the_relapse_backoff() -> None:
    b = Breaker(CONFIG)
    [hot] = feed(b, [(0.0, 200.0), (0.5, 200.0), (1.0, 200.0)])
    b.issued(2, now=1.0)
    calm = feed(b, [(1.5 + t * 0.5, 10.0) for t in range(6)], acked=2)  # acked at 1.5, steps down at 4.0
    assert [t.action for t in calm] == [Action.NONE, Action.STEP_DOWN]
    b.issued(3, now=4.0)
    feed(b, [(4.5, 10.0)], acked=3)  # HALF_OPEN at level 0
    [relapse] = feed(b, [(5.0, 200.0), (5.5, 200.0), (6.0, 200.0)], acked=3)
    assert [t.relapse for t in [hot, *calm]] == [False, False, False]
    assert (relapse.action, relapse.relapse, relapse.meltdown) == (Action.ESCALATE, True, True)
    assert (b.relapses, b.meltdowns, b.wait_s) == (1, 2, 2 * CONFIG.recovery_s)
    # Once more: calm for the doubled wait, down to 0, and a second relapse doubles it again.
    b.issued(4, now=6.0)
    feed(b, [(6.5 + t * 0.5, 10.0) for t in range(10)], acked=4)  # acked at 6.5, steps down at 11.0
    b.issued(5, now=11.0)
    feed(b, [(11.5, 10.0)], acked=5)
    [second] = feed(b, [(12.0, 200.0), (12.5, 200.0), (13.0, 200.0)], acked=5)
    assert second.relapse and (b.relapses, b.meltdowns, b.wait_s) == (2, 3, 4 * CONFIG.recovery_s)


def test_a_breaker_closed_again_forgets_its_causes() -> None:
    b = Breaker(CONFIG)
    feed(b, [(t * 0.5, 200.0) for t in range(3)])
    b.issued(2, now=1.0)
    feed(b, [(1.5, 10.0)], acked=2)
    feed(b, [(2.0 + t * 0.5, 10.0) for t in range(6)], acked=2)  # steps down
    b.issued(3, now=4.5)
    feed(b, [(5.0, 10.0)], acked=3)  # HALF_OPEN at 0
    closed = feed(b, [(5.5 + t * 0.5, 10.0) for t in range(6)], acked=3)
    assert closed[-1].after is Phase.CLOSED and b.causes == () and b.to_dict()["causes"] == []
    assert b.wait_s == CONFIG.recovery_s


@pytest.mark.parametrize(
    ("value", "calm"),
    [(67.9, True), (68.0, False), (80.0, False), (200.0, False)],  # the calm line is 85 * (1 - 0.2) = 68, exclusive
)
def test_calm_lies_strictly_below_the_cap_minus_the_margin(value: float, calm: bool) -> None:
    b = Breaker(CONFIG)
    b.observe(Sample(1.0, latency_ms=value), CAPS)
    assert (b.calm_since is not None, b.calm_count) == (calm, int(calm))


def test_step_down_after_exactly_wait_s_of_exactly_min_samples_calm() -> None:
    two = Breaker.resumed(CONFIG, level=1, now=0.0)
    assert feed(two, [(1.0, 10.0), (3.5, 10.0)]) == []  # calm for longer than wait_s, but only two samples
    b = Breaker.resumed(CONFIG, level=1, now=0.0)
    assert feed(b, [(1.0, 10.0), (2.0, 10.0)]) == []
    [down] = feed(b, [(3.0, 10.0)])  # the third calm sample, 2.0 s after the first: both bounds inclusive
    assert down.action is Action.STEP_DOWN and down.evidence["samples"] == 3
    b.issued(2, now=3.0)
    assert b.calm_count == 0 and b.calm_since is None


def test_the_newest_sample_must_be_over_the_cap() -> None:
    # Three of four over, but the newest one is at the cap (not over) or calm: not "still overloaded now".
    cfg = BreakerConfig(window_s=3.0, min_samples=4, overload_fraction=0.75)
    for newest in (85.0, 20.0):
        assert feed(Breaker(cfg), [(0.0, 90.0), (0.5, 90.0), (1.0, 90.0), (1.5, newest)]) == []
    assert [t.action for t in feed(Breaker(cfg), [(0.0, 90.0), (0.5, 90.0), (1.0, 20.0), (1.5, 90.0)])] == [
        Action.ESCALATE
    ]


def test_a_sample_at_the_window_start_is_outside_it() -> None:
    # At now=3.0 the window is (0.0, 3.0]: the hot sample at exactly 0.0 does not count, leaving 2 of 3 over.
    b = Breaker(CONFIG)
    assert feed(b, [(0.0, 200.0), (1.0, 20.0), (2.0, 200.0), (3.0, 200.0)]) == []


def test_a_resumed_breaker_ignores_samples_up_to_its_resume_time() -> None:
    b = Breaker.resumed(CONFIG, level=2, now=100.0)
    assert (b.level, b.phase) == (2, Phase.OPEN)
    assert feed(b, [(100.0, 200.0), (100.5, 200.0), (101.0, 200.0)]) == []  # only two count
    assert [t.level_after for t in feed(b, [(101.5, 200.0)])] == [3]
    fresh = Breaker.resumed(CONFIG, level=0, now=5.0)
    assert (fresh.level, fresh.phase) == (0, Phase.CLOSED)


def test_undo_is_the_state_before_the_last_transition_only() -> None:
    b = Breaker(CONFIG)
    points = [(0.0, 200.0), (0.5, 200.0), (1.0, 200.0)]
    feed(b, points)
    saved = b.undo()
    assert saved is not None and saved.undo() is None  # one state, not a chain of them
    assert (saved.phase, saved.level, saved.meltdowns) == (Phase.CLOSED, 0, 0)
    # Restored, it decides the same again from the same samples.
    t = saved.decide(1.0, CAPS, 0)
    assert t is not None and t.action is Action.ESCALATE
    b.issued(2, now=1.0)
    feed(b, [(1.5, 200.0)], acked=2)  # the ack: a second transition
    after_ack = b.undo()
    assert after_ack is not None and after_ack.phase is Phase.ESCALATING and after_ack.undo() is None


def test_undo_keeps_its_own_samples_and_their_times_whatever_the_breaker_does_next() -> None:
    """The undo state copies the window (values and times): restored after the live breaker was issued its directive
    (which clears its window) and observed more, it decides what the live one decided, on the same evidence."""
    b = Breaker(CONFIG)
    (first,) = feed(b, [(0.0, 200.0), (0.5, 200.0), (1.0, 300.0)])
    saved = b.undo()
    assert saved is not None
    b.issued(2, now=1.0)
    feed(b, [(1.5, 10.0), (2.0, 10.0), (5.0, 10.0)], acked=2)
    again = saved.decide(1.0, CAPS, 0)
    assert again is not None and again.to_dict() == first.to_dict()
    assert again.evidence["over"]["latency_ms"]["samples"] == 3


@pytest.mark.parametrize(
    ("field", "ok", "bad", "expected"),
    [
        ("window_s", 0.5, 0.0, "> 0"),
        ("min_samples", 1, 0, ">= 1"),
        ("overload_fraction", 1.0, 0.0, "in (0, 1]"),
        ("overload_fraction", 0.01, 1.5, "in (0, 1]"),
        ("margin", 0.0, 1.0, "in [0, 1)"),
        ("recovery_s", 0.5, 0.0, "> 0"),
    ],
)
def test_config_limits_are_inclusive_where_documented(field: str, ok: float, bad: float, expected: str) -> None:
    extra = {"max_recovery_s": 0.5} if field == "recovery_s" else {}
    assert getattr(BreakerConfig(**{field: ok, **extra}), field) == ok
    with pytest.raises(ValueError) as err:
        BreakerConfig(**{field: bad})
    assert str(err.value) == f"{field}={bad!r} is invalid: expected {expected}"


def test_max_recovery_may_equal_recovery() -> None:
    assert BreakerConfig(recovery_s=7.0, max_recovery_s=7.0).max_recovery_s == 7.0
    with pytest.raises(ValueError) as err:
        BreakerConfig(recovery_s=7.0, max_recovery_s=6.0)
    assert str(err.value) == "max_recovery_s=6.0 is invalid: expected >= recovery_s"
