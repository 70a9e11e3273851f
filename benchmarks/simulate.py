"""The cluster simulator's headline numbers: baseline vs DSec on the 128-agent scenario, and simulator speed at scale.

1. ``examples/scenarios/rl-128.yaml`` (128 agents in 8 groups of 16 on 40 shared 80 GB GPUs, one simulated day):
   both regimes on one seeded fault trace; goodput ratio (DSec / baseline), GPU-hours lost per day, interruption
   rate — targets named by issue 9: goodput_ratio >= 1.3, interruption rate under DSec <= 0.3%.
2. ``examples/scenarios/scale-10k.yaml`` (10,000 workers on 1,250 GPUs, one simulated hour): the DSec regime's
   simulated seconds per wall second (target >= 100x), wall time and peak memory.

Both are ratios measured in the same run, so the machine's speed matters only for ``sim_speedup``. The last stdout
line is one JSON object; ``--sweep`` adds the sensitivity sweep of the 128-agent scenario (6 simulated hours per
point, about two minutes here).

    python benchmarks/simulate.py [--hours 24] [--seeds 7,8,9] [--sweep]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from dsec.sim.runner import simulate
from dsec.sim.scenario import load_scenario
from dsec.sim.sweep import findings, sweep

SCENARIOS = Path(__file__).resolve().parent.parent / "examples" / "scenarios"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hours", type=float, default=None, help="simulated hours of the 128-agent run (default: 24)")
    ap.add_argument("--seeds", default="7", help="comma-separated seeds for the 128-agent run (median reported)")
    ap.add_argument("--scale-hours", type=float, default=1.0)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()

    base = load_scenario(SCENARIOS / "rl-128.yaml")
    if args.hours is not None:
        base = base.model_copy(update={"duration_h": args.hours})
    runs: list[dict[str, Any]] = []
    for seed in (int(s) for s in args.seeds.split(",")):
        c = simulate(base.model_copy(update={"seed": seed}))
        h = c.headline()
        runs.append(h)
        b, d = c.summary("baseline"), c.summary("dsec")
        print(
            f"rl-128 seed {seed}: goodput ratio {h['goodput_ratio']}, GPU-hours lost/day "
            f"{b['gpu_hours_lost_per_day']} -> {d['gpu_hours_lost_per_day']}, interruption rate "
            f"{b['interruption_rate']:.3%} -> {d['interruption_rate']:.3%}, interruptions {b['interruptions']} -> "
            f"{d['interruptions']} ({d['interruptions_by_cause']}), wall {d['wall_s']} s",
            file=sys.stderr,
        )
    ratios = [r["goodput_ratio"] for r in runs]
    median_run = sorted(runs, key=lambda r: r["goodput_ratio"])[len(runs) // 2]

    scale = load_scenario(SCENARIOS / "scale-10k.yaml").model_copy(update={"duration_h": args.scale_hours})
    big = simulate(scale)
    bh = big.headline()
    print(
        f"scale-10k: {bh['workers']} workers, {scale.duration_h:g} h in {bh['wall_s']['dsec']} s wall (DSec regime): "
        f"{bh['sim_speedup']}x real time, peak RSS {bh['peak_rss_mb']} MB",
        file=sys.stderr,
    )
    result: dict[str, Any] = {
        "scenario": median_run["scenario"],
        "workers": median_run["workers"],
        "goodput_ratio": median_run["goodput_ratio"],
        "hours_lost_per_day": median_run["hours_lost_per_day"],
        "interruption_rate": median_run["interruption_rate"],
        "sim_speedup": bh["sim_speedup"],
        "seeds": args.seeds,
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
    }
    if args.sweep:
        rows = sweep(base.model_copy(update={"seed": int(args.seeds.split(",")[0])}), hours=6.0)
        result["sweep"] = rows
        result["sweep_findings"] = findings(rows)
        for line in result["sweep_findings"]:
            print(f"sweep: {line}", file=sys.stderr)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
