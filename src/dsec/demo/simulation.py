"""Demo scene for the cluster simulator: the 128-agent scenario for two simulated hours (a few seconds here), baseline
vs DSec's own decision code on one fault trace — the part of the story the demo's two real learners cannot show."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

SCENARIO = "rl-128.yaml"
HOURS = 2.0


def scenario_path() -> Path:
    return Path(str(resources.files("dsec") / "data" / "scenarios" / SCENARIO))


def simulate_cluster(report: Path | None = None, plots_dir: Path | None = None) -> dict[str, Any]:
    """Run the scene; returns the figures for the summary (``error`` when the simulator could not run). With
    ``report`` the report is written there, and with ``plots_dir`` its plots are published for the dashboard."""
    try:
        from dsec.sim.report import write_report
        from dsec.sim.runner import simulate
        from dsec.sim.scenario import load_scenario
    except ImportError as exc:  # numpy missing: the simulator is the `sim` extra
        return {"error": f"simulator unavailable ({exc}); pip install 'dsec[sim]'"}
    sc = load_scenario(scenario_path()).model_copy(update={"duration_h": HOURS})
    c = simulate(sc)
    if report is not None:
        write_report(c, report)
        if plots_dir is not None:
            from dsec.plots import publish

            run = {"scenario": sc.name, "seed": sc.seed, "simulated_h": HOURS, "workers": sc.workers}
            publish(report, plots_dir, run)
    return {"headline": c.headline(), "baseline": c.summary(c.comparator), "dsec": c.summary("dsec")}


def ran(result: dict[str, Any]) -> bool:
    """Both regimes ran and DSec's modules decided: breaker escalations, quota changes and placements happened."""
    if "error" in result:
        return False
    decisions = result["dsec"]["decisions"]
    return (
        result["headline"]["goodput_ratio"] is not None
        and decisions.get("breaker:escalate", 0) > 0
        and decisions.get("quota_changes", 0) > 0
        and decisions.get("placements", 0) > 0
    )


def summary_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    if "error" in result:
        return [("simulator", result["error"])]
    h, b, d = result["headline"], result["baseline"], result["dsec"]
    return [
        (
            f"simulator: {h['workers']} agents, {h['gpus']} GPUs, {h['simulated_h']:g} simulated h",
            f"goodput ratio DSec/tuned baseline {h['goodput_ratio']} (naive {h['goodput_ratio_naive']}), captured "
            f"{h['captured_share']} of the recoverable loss; GPU-hours lost/day {b['gpu_hours_lost_per_day']} -> "
            f"{d['gpu_hours_lost_per_day']}; interruption rate {b['interruption_rate']:.2%} -> "
            f"{d['interruption_rate']:.2%} ({b['interruption_rate_without_capacity_waits']:.2%} -> "
            f"{d['interruption_rate_without_capacity_waits']:.2%} without waiting for capacity); "
            f"recovery p50 {b['recovery_s_p50']} s -> {d['recovery_s_p50']} s; "
            f"{d['meltdowns']} meltdowns; {d['sim_speedup']}x real time (dsec simulate, docs/simulator.md)",
        )
    ]
