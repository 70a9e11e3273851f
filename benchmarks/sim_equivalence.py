"""Dump everything the simulator decides and measures for three fixed runs, to compare two versions of DSec.

Used to prove a refactor of the decision code changed no behaviour (issue 16): run it before and after, then
``--compare BEFORE AFTER`` lists every differing key (exit 1 when any differs). Wall-clock keys are dropped.

    python benchmarks/sim_equivalence.py --out before.json
    python benchmarks/sim_equivalence.py --out after.json
    python benchmarks/sim_equivalence.py --compare before.json after.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

RUNS = {
    # name: (scenario file, hours, --set overrides)
    "rl-128-4h": ("rl-128.yaml", 4.0, []),
    "one-worker-per-card-2h": ("rl-128.yaml", 2.0, ["cluster.workers_per_gpu=1", "cluster.nodes=16"]),
    "scale-10k-0.15h": ("scale-10k.yaml", 0.15, []),
}
VOLATILE = {"wall_s", "sim_speedup", "peak_rss_mb"}


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(np.asarray(a, dtype=np.float64)).tobytes()).hexdigest()[:16]


def _clean(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _clean(v) for k, v in d.items() if k not in VOLATILE}
    return d


def run_one(scenario: str, hours: float, sets: list[str]) -> dict[str, Any]:
    from importlib import resources

    from dsec.sim.runner import simulate
    from dsec.sim.scenario import load_scenario, with_overrides

    path = Path(str(resources.files("dsec") / "data" / "scenarios" / scenario))
    sc = with_overrides(load_scenario(path), [*sets, f"duration_h={hours}"])
    cmp = simulate(sc)
    out: dict[str, Any] = {}
    for name, o in cmp.outcomes.items():
        out[name] = {
            "summary": _clean(cmp.summary(name)),
            "progress": _digest(o.progress),
            "rolled_back": _digest(o.rolled_back),
            "down_s": _digest(o.down_s),
            "pending_s": _digest(o.pending_s),
            "timeline": _digest(np.array(o.timeline)),
            "interruptions": hashlib.sha256(repr(o.interruptions).encode()).hexdigest()[:16],
        }
    return out


def compare(a: dict[str, Any], b: dict[str, Any], path: str = "") -> list[str]:
    diffs: list[str] = []
    for k in sorted(set(a) | set(b)):
        p = f"{path}.{k}" if path else k
        if k not in a or k not in b:
            diffs.append(f"{p}: only in {'after' if k not in a else 'before'}")
        elif isinstance(a[k], dict) and isinstance(b[k], dict):
            diffs += compare(a[k], b[k], p)
        elif a[k] != b[k]:
            diffs.append(f"{p}: {a[k]!r} -> {b[k]!r}")
    return diffs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--only", choices=sorted(RUNS))
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args()
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        diffs = compare(before, after)
        for d in diffs:
            print(d)
        print(json.dumps({"identical": not diffs, "differences": len(diffs)}))
        return 1 if diffs else 0
    result = {name: run_one(*spec) for name, spec in RUNS.items() if args.only in (None, name)}
    text = json.dumps(result, indent=1, sort_keys=True)
    if args.out:
        args.out.write_text(text)
    print(json.dumps({"runs": sorted(result)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
