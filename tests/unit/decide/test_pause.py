"""The ladder's top rung only where it pays (dsec.decide.pause): the measured progress curve, the rule's threshold,
the breaker holding below its top, and a beat's judgment for an actor and a learner."""

from __future__ import annotations

import math

import pytest

from dsec.breaker import MAX_LEVEL, Breaker, BreakerConfig, Caps, Phase, Sample
from dsec.decide import BeatInputs, WorkerView, caps_for, judge_beat
from dsec.decide.beat import top_level
from dsec.decide.pause import SAMPLING_PROGRESS, learner_step_ms, pause_pays, progress_left
from dsec.health.interventions import PrecisionGuard
from dsec.model import DirectiveFields, Pool, PoolThresholds


def test_progress_left_passes_through_the_measured_points_and_the_ends() -> None:
    assert progress_left(1.0) == 1.0 and progress_left(0.0) == 0.0
    for share, progress in SAMPLING_PROGRESS:
        assert progress_left(share) == pytest.approx(progress)
    assert progress_left(0.25) == pytest.approx(0.432 / 2)
    assert progress_left(14 / 15) == pytest.approx(0.739 + (1 - 0.739) * (14 / 15 - 0.75) / 0.25)
    assert progress_left(1.5) == 1.0 and progress_left(-1.0) == 0.0
    assert progress_left(0.5, [(0.5, 0.5)]) == 0.5  # a curve of one's own


@pytest.mark.parametrize(
    ("actors", "threshold_ms"),
    [(15, 4 * (1 - progress_left(14 / 15)) * 600), (4, 4 * (1 - 0.739) * 600), (1, 4 * 600)],
)
def test_pause_pays_past_the_lateness_one_actor_s_samples_are_worth(actors: int, threshold_ms: float) -> None:
    # One sync every 4 steps of 600 ms: the wait ended per step against the progress given up per step.
    assert not pause_pays(threshold_ms - 1.0, 4, 600.0, actors)
    assert pause_pays(threshold_ms + 1.0, 4, 600.0, actors)
    assert threshold_ms == pytest.approx({15: 167.0, 4: 626.4, 1: 2400.0}[actors], abs=1.0)


def test_unknown_inputs_leave_the_ladder_as_it_was() -> None:
    for cost, step, actors in ((None, 600.0, 15), (50.0, None, 15), (50.0, 600.0, 0), (math.nan, 600.0, 15)):
        assert pause_pays(cost, 4, step, actors)
    assert not pause_pays(-30.0, 4, 600.0, 15)  # early, not late: nothing to end


def test_top_level_is_lowered_for_an_actor_only() -> None:
    assert top_level("actor", 20.0, 4, 600.0, 15) == MAX_LEVEL - 1
    assert top_level("actor", 2000.0, 4, 600.0, 15) == MAX_LEVEL
    assert top_level("learner", 20.0, 4, 600.0, 15) == MAX_LEVEL
    assert top_level("actor", 20.0, 4, 600.0, None) == MAX_LEVEL  # actors not counted yet


def _at_rung_below_top(lat_ms: float) -> Breaker:
    """A breaker at the level below the top, in force, with fresh overload evidence of ``lat_ms``."""
    b = Breaker.resumed(BreakerConfig(window_s=3.0, min_samples=3), MAX_LEVEL - 1, 0.0)
    assert b.phase is Phase.OPEN
    for ts in (1.0, 2.0, 3.0):
        b.observe(Sample(ts, latency_ms=lat_ms), Caps(latency_ms=85.0))
    return b


def test_the_breaker_holds_at_its_top_level_under_overload() -> None:
    held = _at_rung_below_top(150.0)
    assert held.decide(3.0, Caps(latency_ms=85.0), 0, top_level=MAX_LEVEL - 1) is None
    assert held.level == MAX_LEVEL - 1
    t = _at_rung_below_top(150.0).decide(3.0, Caps(latency_ms=85.0), 0)
    assert t is not None and t.level_after == MAX_LEVEL


def test_window_median_is_over_the_evidence_window() -> None:
    b = Breaker(config=BreakerConfig(window_s=3.0))
    assert b.window_median("latency_ms") is None
    for ts, lat in ((1.0, 10.0), (2.0, 500.0), (3.0, 30.0), (4.0, 40.0)):
        b.observe(Sample(ts, latency_ms=lat), Caps())
    assert b.window_median("latency_ms") == pytest.approx(35.0)  # 10, 500, 30, 40: the window reaches back to 1.0
    b.observe(Sample(4.5, bandwidth_mbps=1.0), Caps())  # the sample at 1.0 leaves it; this one carries no latency
    assert b.window_median("latency_ms") == pytest.approx(40.0)


POOL = Pool("p", thresholds=PoolThresholds(latency_cap_ms=85.0))


def _beat(role: str, cost_ms: float, actors: int) -> tuple[Breaker, BeatInputs]:
    fields = DirectiveFields(compression_bits=4, grad_accum_steps=4)
    metrics = {"sync_cost_ms_p50": cost_ms, "step_ms_mean": 600.0}
    w = WorkerView("w1", "p", role, "g", 1, fields=fields, metrics=metrics)
    b = _at_rung_below_top(cost_ms)
    return b, BeatInputs(w, POOL, caps_for(POOL.thresholds, None, fields), metrics, (), 0, 4.0, actors)


@pytest.mark.parametrize(("role", "cost_ms", "pauses"), [("actor", 150.0, False), ("actor", 400.0, True),
                                                          ("learner", 150.0, True)])  # fmt: skip
def test_a_beat_pauses_an_actor_only_when_its_lateness_outweighs_its_samples(
    role: str, cost_ms: float, pauses: bool
) -> None:
    b, beat = _beat(role, cost_ms, actors=15)
    v = judge_beat(beat, b, PrecisionGuard())
    if pauses:
        assert b.level == MAX_LEVEL and v.patch.get("async_sampling") is False
    else:
        assert b.level == MAX_LEVEL - 1 and "async_sampling" not in v.patch and not v.breaker_moved


def test_an_actor_without_a_step_time_of_its_own_is_judged_against_its_learners_step() -> None:
    fields = DirectiveFields(compression_bits=4, grad_accum_steps=4)
    metrics = {"sync_cost_ms_p50": 150.0}  # an actor that steps no optimizer reports no step_ms_mean
    w = WorkerView("w1", "p", "actor", "g", 1, fields=fields, metrics=metrics)
    caps = caps_for(POOL.thresholds, None, fields)
    held, paused = _at_rung_below_top(150.0), _at_rung_below_top(150.0)
    judge_beat(BeatInputs(w, POOL, caps, metrics, (), 0, 4.0, 15, 600.0), held, PrecisionGuard())
    judge_beat(BeatInputs(w, POOL, caps, metrics, (), 0, 4.0, 15, None), paused, PrecisionGuard())
    assert held.level == MAX_LEVEL - 1  # against the learners' 600 ms steps: not worth it
    assert paused.level == MAX_LEVEL  # no step time anywhere: the ladder as before


def test_learner_step_ms_is_the_median_over_learners_that_report_one() -> None:
    def v(role: str, step: object) -> WorkerView:
        return WorkerView("w", "p", role, "g", 0, metrics={} if step is None else {"step_ms_mean": step})  # type: ignore[dict-item]

    assert learner_step_ms([v("learner", 500.0), v("learner", 700.0), v("learner", 650.0)]) == 650.0
    assert learner_step_ms([v("learner", 500.0), v("actor", 9000.0), v("learner", None), v("learner", True)]) == 500.0
    assert learner_step_ms([v("learner", math.nan), v("learner", 0.0), v("actor", 600.0)]) is None
    assert learner_step_ms([]) is None


def test_the_fleet_pass_counts_a_pools_actors_and_its_learners_step() -> None:
    from dsec.decide import judge_pool
    from dsec.health.fleet import FleetConfig

    ws = [WorkerView("l", "p", "learner", "g", 0, metrics={"step_ms_mean": 600.0})] + [
        WorkerView(f"a{i}", "p", "actor", "g", i + 1, metrics={"env_steps_total": 10.0}) for i in range(3)
    ]
    v = judge_pool(POOL, "p", ws, {}, False, FleetConfig(), 1.0)
    assert (v.actors, v.learner_step_ms) == (3, 600.0)
