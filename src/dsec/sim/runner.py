"""Run the regimes of a scenario on one fault trace and derive the figures the report and the benchmark show."""

from __future__ import annotations

import resource
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dsec.policy import PolicySet
from dsec.sim.dsec_regime import DsecRegime
from dsec.sim.engine import Outcome, Simulation
from dsec.sim.regimes import (
    Baseline,
    Regime,
    TunedBaseline,
    example_policy_files,
    policies_from,
    young_daly_interval_s,
)
from dsec.sim.scenario import Scenario
from dsec.sim.world import Kind, Trace, generate, layout_of, truth_of

REGIMES = ("baseline", "tuned", "dsec")  # naive baseline, tuned baseline, DSec


def scenario_policies(sc: Scenario) -> PolicySet:
    """The policy files the scenario names (relative to its own file), or the shipped examples."""
    if sc.dsec.policies is None:
        return policies_from(example_policy_files())
    here = Path(sc.source).parent if sc.source else Path.cwd()
    return policies_from([p if p.is_absolute() else here / p for p in map(Path, sc.dsec.policies)])


def make_regime(name: str, sc: Scenario, policies: PolicySet | None, checkpoint_interval_s: float = 600.0) -> Regime:
    if name == "baseline":
        return Baseline(sc)
    if name == "tuned":
        return TunedBaseline(sc, sc.baseline.tuned.checkpoint_interval_s or checkpoint_interval_s)
    if name == "dsec":
        return DsecRegime(sc, policies)
    raise ValueError(f"regime {name!r} is unknown: expected one of {', '.join(REGIMES)}")


@dataclass
class Comparison:
    scenario: Scenario
    outcomes: dict[str, Outcome]
    trace_counts: dict[str, int] = field(default_factory=dict)
    bad_gpus: int = 0
    ideal_goodput_steps_per_s: float | None = None

    def summary(self, name: str) -> dict[str, Any]:
        return summarize(self.outcomes[name])

    @property
    def comparator(self) -> str:
        """The baseline DSec is judged against: the tuned one when it ran (issue 17), else the naive one."""
        return "tuned" if "tuned" in self.outcomes else "baseline"

    def headline(self) -> dict[str, Any]:
        """The benchmark's JSON. ``baseline`` is the comparator (the tuned baseline when it ran); ``naive`` the
        Kubernetes + torchrun defaults; ``captured_share`` is DSec's share of the loss that could be recovered,
        (DSec - baseline) / (ideal - baseline), the ideal being a fault-free run that still loses the power window."""
        b, d = self.summary(self.comparator), self.summary("dsec")
        n = self.summary("baseline")

        def ratio(x: dict[str, Any]) -> float | None:
            return (
                round(d["goodput_steps_per_s"] / x["goodput_steps_per_s"], 4) if x["goodput_steps_per_s"] > 0 else None
            )

        ideal = self.ideal_goodput_steps_per_s
        gap = None if ideal is None else ideal - b["goodput_steps_per_s"]
        captured = round((d["goodput_steps_per_s"] - b["goodput_steps_per_s"]) / gap, 4) if gap and gap > 0 else None
        return {
            "scenario": self.scenario.name,
            "workers": self.scenario.workers,
            "gpus": self.scenario.gpus,
            "simulated_h": self.scenario.duration_h,
            "baseline": self.comparator,
            "goodput_ratio": ratio(b),
            "goodput_ratio_naive": ratio(n),
            "captured_share": captured,
            "goodput_steps_per_s": {
                "baseline": b["goodput_steps_per_s"],
                "naive": n["goodput_steps_per_s"],
                "dsec": d["goodput_steps_per_s"],
                "ideal": None if ideal is None else round(ideal, 4),
            },
            "hours_lost_per_day": {
                "baseline": b["gpu_hours_lost_per_day"],
                "naive": n["gpu_hours_lost_per_day"],
                "dsec": d["gpu_hours_lost_per_day"],
            },
            "interruption_rate": {
                "baseline": b["interruption_rate"],
                "naive": n["interruption_rate"],
                "dsec": d["interruption_rate"],
            },
            "interruption_rate_without_capacity_waits": {
                "baseline": b["interruption_rate_without_capacity_waits"],
                "dsec": d["interruption_rate_without_capacity_waits"],
            },
            "sync_success_rate": {"baseline": b["sync_success_rate"], "dsec": d["sync_success_rate"]},
            "meltdowns": d["meltdowns"],
            "sim_speedup": d["sim_speedup"],
            "wall_s": {"baseline": b["wall_s"], "dsec": d["wall_s"]},
            "peak_rss_mb": max(b["peak_rss_mb"], d["peak_rss_mb"]),
        }


def simulate(
    sc: Scenario,
    regimes: tuple[str, ...] = REGIMES,
    policies: PolicySet | None = None,
    on_progress: Callable[[float, float], None] | None = None,
) -> Comparison:
    """Every regime on the same hidden truth and the same fault trace. The tuned baseline's checkpoint interval is
    Young/Daly for the rate of failures that roll the learner back, as the naive baseline measured it (unless the
    scenario fixes it).

    ``on_progress(done, total)``: simulated hours done over all regimes (the regimes run one after the other, each
    over the whole horizon), reported every 10 simulated minutes."""
    layout = layout_of(sc)
    truth = truth_of(sc, np.random.default_rng([sc.seed, 1]))
    trace = generate(sc, layout, truth)
    if policies is None and "dsec" in regimes:
        policies = scenario_policies(sc)
    outcomes: dict[str, Outcome] = {}
    interval = sc.baseline.checkpoint_interval_s
    order = sorted(regimes, key=("baseline", "tuned", "dsec").index)
    total_h = sc.duration_h * len(order)
    for i, name in enumerate(order):
        sim = Simulation(sc, make_regime(name, sc, policies, interval), trace=trace, truth=truth)

        def ticked(k: int, ticks: int, before: float = i * sc.duration_h) -> None:
            if on_progress is not None:
                on_progress(before + sc.duration_h * k / ticks, total_h)

        outcome = sim.run(ticked)
        outcome.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        outcomes[name] = outcome
        if name == "baseline":
            # The failures a checkpoint is for: those that roll the learner back (with actor fault tolerance, an
            # actor's failure does not; the naive baseline restarts the group on every failure, so count by victims).
            rollback_only = sc.baseline.tuned.actor_fault_tolerance
            failures = sum(
                1 for i in outcome.interruptions if i.cause != "power" and (i.learners > 0 or not rollback_only)
            )
            mtbf = outcome.groups * outcome.duration_s / max(1, failures)
            interval = young_daly_interval_s(sc.baseline.tuned.checkpoint_blocking_s, mtbf)
    return Comparison(sc, outcomes, dict(trace.counts), int(truth.bad.sum()), ideal_goodput(sc, trace))


def ideal_goodput(sc: Scenario, trace: Trace) -> float:
    """Useful steps/s of a fault-free run that still loses what nobody can avoid: the groups that do not fit on the
    cards left during the power-saving window (no checkpoint cost, no straggler, no failure)."""
    layout = layout_of(sc)
    rate = 1.0 / (
        sc.groups.step_s
        + (sc.network.base_latency_ms + sc.groups.gradient_mb / sc.network.link_mb_per_s * 1000.0) / 1000.0
    )
    horizon = sc.duration_h * 3600.0
    slots_on = (layout.cards - len(trace.power_cards)) * layout.workers_per_gpu
    fit = min(sc.groups.count, slots_on // sc.groups.size)
    lost = 0.0
    off_at = None
    for t, kind in zip(trace.times.tolist(), trace.kinds.tolist(), strict=True):
        if kind == Kind.POWER_OFF and off_at is None:
            off_at = min(t, horizon)
        elif kind == Kind.POWER_ON and off_at is not None:
            lost += (min(t, horizon) - off_at) * (sc.groups.count - fit)
            off_at = None
    if off_at is not None:
        lost += (horizon - off_at) * (sc.groups.count - fit)
    return rate * (sc.groups.count * horizon - lost) / horizon


def _r(x: float, nd: int = 4) -> float:
    return round(float(x), nd)


def summarize(o: Outcome) -> dict[str, Any]:
    T, G = o.duration_s, o.groups
    per_day = 86400.0 / T
    ideal_steps = o.ideal_rate * T  # one group, no fault, no loss
    useful = float(o.progress.sum())
    # Group-seconds, then GPU-hours per day: a group holds gpus_per_group GPUs.
    down_s, pending_s, blocked_s = float(o.down_s.sum()), float(o.pending_s.sum()), float(o.blocked_s.sum())
    redone_s = float(o.rolled_back.sum()) / o.ideal_rate
    gpu_h_per_day = o.gpus_per_group / 3600.0 * per_day
    lost_total = float(np.sum(T - o.progress / o.ideal_rate)) * gpu_h_per_day
    down, pending, blocked, rollback = (x * gpu_h_per_day for x in (down_s, pending_s, blocked_s, redone_s))
    recov = [i.recovery_s for i in o.interruptions]
    causes = Counter(i.cause for i in o.interruptions)
    return {
        "regime": o.regime,
        "goodput_steps_per_s": _r(useful / T, 4),
        "effective_fraction": _r(useful / (ideal_steps * G), 4),
        "gpu_hours_lost_per_day": _r(lost_total, 2),
        "gpu_hours_lost_breakdown": {
            "restarting": _r(down, 2),
            "waiting_for_capacity": _r(pending, 2),
            "checkpoint_or_snapshot": _r(blocked, 2),
            "work_redone": _r(rollback, 2),
            "slow_steps_and_efficiency": _r(lost_total - down - pending - blocked - rollback, 2),
        },
        # Share of group-time lost to interruptions: restarting, waiting for capacity, saving state, and redoing the
        # work a failure rolled back (slow steps are not interruptions; they are in the GPU-hours lost).
        "interruption_rate": _r((down_s + pending_s + blocked_s + redone_s) / (G * T), 5),
        # The same without waiting for capacity (the power-saving window takes GPUs away from both regimes alike).
        "interruption_rate_without_capacity_waits": _r((down_s + blocked_s + redone_s) / (G * T), 5),
        "interruptions": len(o.interruptions),
        "interruptions_by_cause": dict(sorted(causes.items())),
        "interruptions_per_group_day": _r(len(o.interruptions) / G * per_day, 3),
        "recovery_s_p50": _r(statistics.median(recov), 3) if recov else None,
        "recovery_s_max": _r(max(recov), 3) if recov else None,
        "sync_success_rate": _r(o.sync_ok / o.sync_ops, 5) if o.sync_ops else None,
        "meltdowns": o.meltdowns,
        "decisions": o.decisions,
        "wall_s": _r(o.wall_s, 2),
        "sim_speedup": _r(T / o.wall_s, 1) if o.wall_s > 0 else None,
        "peak_rss_mb": _r(o.peak_rss_mb, 1),
    }
