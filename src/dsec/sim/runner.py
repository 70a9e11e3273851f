"""Run the regimes of a scenario on one fault trace and derive the figures the report and the benchmark show."""

from __future__ import annotations

import resource
import statistics
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dsec.policy import PolicySet
from dsec.sim.dsec_regime import DsecRegime
from dsec.sim.engine import Outcome, Simulation
from dsec.sim.regimes import Baseline, Regime, example_policy_files, policies_from
from dsec.sim.scenario import Scenario
from dsec.sim.world import generate, layout_of, truth_of

REGIMES = ("baseline", "dsec")


def scenario_policies(sc: Scenario) -> PolicySet:
    """The policy files the scenario names (relative to its own file), or the shipped examples."""
    if sc.dsec.policies is None:
        return policies_from(example_policy_files())
    here = Path(sc.source).parent if sc.source else Path.cwd()
    return policies_from([p if p.is_absolute() else here / p for p in map(Path, sc.dsec.policies)])


def make_regime(name: str, sc: Scenario, policies: PolicySet | None) -> Regime:
    if name == "baseline":
        return Baseline(sc)
    if name == "dsec":
        return DsecRegime(sc, policies)
    raise ValueError(f"regime {name!r} is unknown: expected one of {', '.join(REGIMES)}")


@dataclass
class Comparison:
    scenario: Scenario
    outcomes: dict[str, Outcome]
    trace_counts: dict[str, int] = field(default_factory=dict)
    bad_gpus: int = 0

    def summary(self, name: str) -> dict[str, Any]:
        return summarize(self.outcomes[name])

    def headline(self) -> dict[str, Any]:
        """The benchmark's JSON: keys as issue 9 names them, plus context."""
        b, d = self.summary("baseline"), self.summary("dsec")
        return {
            "scenario": self.scenario.name,
            "workers": self.scenario.workers,
            "gpus": self.scenario.gpus,
            "simulated_h": self.scenario.duration_h,
            "goodput_ratio": round(d["goodput_steps_per_s"] / b["goodput_steps_per_s"], 4)
            if b["goodput_steps_per_s"] > 0
            else None,
            "goodput_steps_per_s": {"baseline": b["goodput_steps_per_s"], "dsec": d["goodput_steps_per_s"]},
            "hours_lost_per_day": {"baseline": b["gpu_hours_lost_per_day"], "dsec": d["gpu_hours_lost_per_day"]},
            "interruption_rate": {"baseline": b["interruption_rate"], "dsec": d["interruption_rate"]},
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


def simulate(sc: Scenario, regimes: tuple[str, ...] = REGIMES, policies: PolicySet | None = None) -> Comparison:
    """Every regime on the same hidden truth and the same fault trace."""
    layout = layout_of(sc)
    truth = truth_of(sc, np.random.default_rng([sc.seed, 1]))
    trace = generate(sc, layout, truth)
    if policies is None and "dsec" in regimes:
        policies = scenario_policies(sc)
    outcomes: dict[str, Outcome] = {}
    for name in regimes:
        sim = Simulation(sc, make_regime(name, sc, policies), trace=trace, truth=truth)
        outcome = sim.run()
        outcome.peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
        outcomes[name] = outcome
    return Comparison(sc, outcomes, dict(trace.counts), int(truth.bad.sum()))


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
