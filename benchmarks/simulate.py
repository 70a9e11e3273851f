"""The cluster simulator's headline numbers: DSec vs a competent baseline on the 128-agent scenario, and at scale.

1. ``examples/scenarios/rl-128.yaml`` (128 agents in 8 groups of 16 on 40 shared 80 GB GPUs, one simulated day):
   the naive baseline, the tuned baseline and DSec on one seeded fault trace. Keys as issue 17 names them:
   ``goodput_ratio`` (DSec / tuned baseline, median over the seeds), ``goodput_ratio_naive``, ``captured_share``
   (DSec's share of the recoverable loss, (DSec - tuned) / (ideal - tuned)), ``worst_goodput_ratio`` (over every
   shipped scenario run here and every sweep row), ``interruption_rate`` {baseline, dsec}, ``scenarios``.
   Targets: captured_share >= 0.5, worst_goodput_ratio >= 1.0.
2. ``examples/scenarios/scale-10k.yaml`` (10,000 workers on 1,250 GPUs, one simulated hour): the DSec regime's
   simulated seconds per wall second (target >= 100x), wall time and peak memory.

Both are ratios measured in the same run, so the machine's speed matters only for ``sim_speedup``. The last stdout
line is one JSON object; ``--sweep`` adds the sensitivity sweep of the 128-agent scenario (6 simulated hours per
point, about two minutes here).

    python benchmarks/simulate.py [--hours 24] [--seeds 7,8,9] [--sweep] [--set dsec.snapshot_cadence=failure_history]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from dsec.sim.runner import simulate
from dsec.sim.scenario import load_scenario, with_overrides
from dsec.sim.sweep import findings, sweep

SCENARIOS = Path(__file__).resolve().parent.parent / "examples" / "scenarios"


def _entry(h: dict[str, Any]) -> dict[str, Any]:
    return {k: h[k] for k in ("goodput_ratio", "goodput_ratio_naive", "captured_share")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hours", type=float, default=None, help="simulated hours of the 128-agent run (default: 24)")
    ap.add_argument("--seeds", default="7,8,9", help="comma-separated seeds for the 128-agent run (median reported)")
    ap.add_argument("--scale-hours", type=float, default=1.0)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="PATH=VALUE",
        help="override a field of both scenarios, e.g. dsec.snapshot_cadence=failure_history (a design study)",
    )
    args = ap.parse_args()

    base = with_overrides(load_scenario(SCENARIOS / "rl-128.yaml"), args.set)
    if args.hours is not None:
        base = base.model_copy(update={"duration_h": args.hours})
    runs: list[dict[str, Any]] = []
    for seed in (int(s) for s in args.seeds.split(",")):
        c = simulate(base.model_copy(update={"seed": seed}))
        h = {**c.headline(), "seed": seed}
        runs.append(h)
        b, d = c.summary(c.comparator), c.summary("dsec")
        print(
            f"rl-128 seed {seed}: goodput ratio vs tuned {h['goodput_ratio']} (naive {h['goodput_ratio_naive']}), "
            f"captured share {h['captured_share']}, GPU-hours lost/day "
            f"{b['gpu_hours_lost_per_day']} -> {d['gpu_hours_lost_per_day']}, interruption rate "
            f"{b['interruption_rate']:.3%} -> {d['interruption_rate']:.3%}, interruptions {b['interruptions']} -> "
            f"{d['interruptions']} ({d['interruptions_by_cause']}), wall {d['wall_s']} s",
            file=sys.stderr,
        )
    ratios = [r["goodput_ratio"] for r in runs]
    median_run = sorted(runs, key=lambda r: r["goodput_ratio"])[len(runs) // 2]

    scale = with_overrides(load_scenario(SCENARIOS / "scale-10k.yaml"), args.set)
    scale = scale.model_copy(update={"duration_h": args.scale_hours})
    big = simulate(scale)
    bh = big.headline()
    print(
        f"scale-10k: {bh['workers']} workers, {scale.duration_h:g} h in {bh['wall_s']['dsec']} s wall (DSec regime): "
        f"{bh['sim_speedup']}x real time, peak RSS {bh['peak_rss_mb']} MB",
        file=sys.stderr,
    )
    scenarios: dict[str, Any] = {f"rl-128/seed-{r['seed']}": _entry(r) for r in runs}
    scenarios["scale-10k"] = _entry(bh)
    result: dict[str, Any] = {
        "scenario": median_run["scenario"],
        "workers": median_run["workers"],
        "goodput_ratio": median_run["goodput_ratio"],
        "goodput_ratio_naive": median_run["goodput_ratio_naive"],
        "captured_share": median_run["captured_share"],
        "worst_goodput_ratio": None,
        "hours_lost_per_day": median_run["hours_lost_per_day"],
        "interruption_rate": median_run["interruption_rate"],
        "interruption_rate_without_capacity_waits": median_run["interruption_rate_without_capacity_waits"],
        "goodput_steps_per_s": median_run["goodput_steps_per_s"],
        "sim_speedup": bh["sim_speedup"],
        "seeds": args.seeds,
        "overrides": args.set,
        "goodput_ratio_per_seed": ratios,
        "goodput_ratio_spread": [min(ratios), max(ratios)] if len(ratios) > 1 else None,
        "goodput_ratio_median": statistics.median(ratios),
        "simulated_h": median_run["simulated_h"],
        "scale": {
            "workers": bh["workers"],
            "gpus": bh["gpus"],
            "simulated_h": scale.duration_h,
            "wall_s": bh["wall_s"],
            "sim_speedup": bh["sim_speedup"],
            "peak_rss_mb": bh["peak_rss_mb"],
            "goodput_ratio": bh["goodput_ratio"],
        },
        "scenarios": scenarios,
    }
    if args.sweep:
        rows = sweep(base.model_copy(update={"seed": int(args.seeds.split(",")[0])}), hours=6.0)
        result["sweep"] = rows
        result["sweep_findings"] = findings(rows)
        for r in rows:
            scenarios[f"sweep/{r['parameter']}={r['value']:g}"] = {
                k: r[k] for k in ("goodput_ratio", "goodput_ratio_naive", "captured_share")
            }
        for line in result["sweep_findings"]:
            print(f"sweep: {line}", file=sys.stderr)
    measured = [v["goodput_ratio"] for v in scenarios.values() if v["goodput_ratio"] is not None]
    result["worst_goodput_ratio"] = min(measured) if measured else None
    print(json.dumps(result))


if __name__ == "__main__":
    main()
